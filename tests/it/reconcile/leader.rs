//! Leader election's Kubernetes API traffic against a mock API server (tower-test): the process
//! creates its Lease, takes it, and every request it sends is granted by `rbac::API_CALLS`,
//! whose Lease entry lists exactly the verbs used.

use std::collections::BTreeSet;
use std::time::Duration;

use serde_json::json;

use crate::support::mock_api::{ApiHandle, Call, MockLease, mock_client};
use proxy_operator::leader::{LeaderConfig, watch_leadership};
use proxy_operator::rbac::{self, API_CALLS};

const LEASE_PATH: &str = "/apis/coordination.k8s.io/v1/namespaces/proxy-operator/leases";

/// Answers Lease requests like an API server holding at most one Lease. Returns the RBAC
/// verbs seen.
async fn serve_lease(mut handle: ApiHandle) -> BTreeSet<&'static str> {
    let mut lease = MockLease::default();
    let mut verbs = BTreeSet::new();
    while let Some(call) = Call::next_or_end(&mut handle).await {
        let attributes = rbac::request_attributes(call.method.as_str(), &call.target).unwrap();
        assert_eq!(attributes.resource, "leases");
        verbs.insert(attributes.verb);
        assert!(call.path.starts_with(LEASE_PATH), "{}", call.target);
        let (code, mut body) = lease.answer(call.method.as_str(), &call.body);
        if code < 300 {
            body["metadata"]["namespace"] = json!("proxy-operator");
        }
        call.respond(code, body);
    }
    verbs
}

#[tokio::test]
async fn takes_the_lease_with_exactly_the_granted_calls() {
    let (client, handle) = mock_client();
    let server = tokio::spawn(serve_lease(handle));

    let config = LeaderConfig::new("proxy-operator", "proxy-operator-7d9f");
    let mut leader =
        tokio::time::timeout(Duration::from_secs(30), watch_leadership(client, &config))
            .await
            .expect("leader election did not start")
            .expect("leader election failed to start");
    tokio::time::timeout(Duration::from_secs(30), leader.wait_for(|l| *l))
        .await
        .expect("never became leader")
        .unwrap();

    // Stop contending: the manager releases the Lease and the mock's client side goes away.
    drop(leader);
    let verbs = tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("leader election kept calling the API")
        .unwrap();
    let listed: BTreeSet<&str> = API_CALLS
        .iter()
        .find(|call| call.resource == "leases")
        .unwrap()
        .verbs
        .iter()
        .copied()
        .collect();
    assert_eq!(verbs, listed, "verbs used on Leases vs rbac::API_CALLS");
}
