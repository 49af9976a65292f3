//! The install as users run it: the manifests and their RBAC, the Helm chart, the Deployment's
//! Pod run the way a kubelet runs it, tenants (the overlay, the chart's values, their Pod), and
//! the kind quickstart (ignored: it needs Docker).

mod helm_chart;
mod manifests;
mod pod;
mod quickstart_kind;
mod tenants;
