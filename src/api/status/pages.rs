//! The status page's HTML, rendered on the server from the views in [`super::view`], so it
//! works without JavaScript; `status.js` only re-fetches the page and swaps the parts marked
//! `data-live`. Every value is escaped by maud.

use maud::{DOCTYPE, Markup, html};

use super::chart::{self, Chart, Style, Unit, format_bytes, format_money};
use super::spend::{ChartSeries, ChartsView, SpendRow, SpendView, SpendWindow};
use super::view::{
    Badge, EventsView, ExitRow, FleetView, Order, ProxiesFilter, ProxiesView, ProxyDetail,
    ProxyRow, SortKey, TargetsView,
};
use crate::api::types::LastFailureView;
use crate::ledger::HOUR_MS;

/// Which section a page belongs to, for the navigation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Section {
    /// `/`.
    Fleet,
    /// `/proxies` and one proxy's page.
    Proxies,
    /// `/targets`.
    Targets,
    /// `/events`.
    Events,
    /// `/spend`.
    Spend,
}

/// How the viewer got in, shown on every page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Signed in with a token: a sign-out button.
    SignedIn,
    /// `--insecure-no-auth`: open to anyone, and the page says so.
    Open,
}

const SECTIONS: [(Section, &str, &str); 5] = [
    (Section::Fleet, "/", "Fleet"),
    (Section::Proxies, "/proxies", "Proxies"),
    (Section::Targets, "/targets", "Targets"),
    (Section::Spend, "/spend", "Spend"),
    (Section::Events, "/events", "Lease events"),
];

fn layout(title: &str, section: Option<Section>, access: Option<Access>, body: Markup) -> Markup {
    html! {
        (DOCTYPE)
        html lang="en" {
            head {
                meta charset="utf-8";
                meta name="viewport" content="width=device-width, initial-scale=1";
                title { (title) " · proxy-operator" }
                link rel="icon" type="image/svg+xml" href="/assets/favicon.svg";
                link rel="stylesheet" href="/assets/status.css";
                script src="/assets/status.js" defer {}
            }
            body {
                header {
                    a.brand href="/" { "proxy-operator" }
                    @if access.is_some() {
                        nav aria-label="Sections" {
                            ul {
                                @for (s, href, label) in SECTIONS {
                                    li {
                                        @if Some(s) == section {
                                            a href=(href) aria-current="page" { (label) }
                                        } @else {
                                            a href=(href) { (label) }
                                        }
                                    }
                                }
                            }
                        }
                    }
                    @if access == Some(Access::SignedIn) {
                        form.signout method="post" action="/signout" {
                            button type="submit" { "Sign out" }
                        }
                    }
                }
                @if access == Some(Access::Open) {
                    p.banner.open role="note" {
                        strong { "Open access: " }
                        "started with --insecure-no-auth, so anyone who can reach this address sees this page and can use the API."
                    }
                }
                main #content data-refresh=[section.map(|_| "on")] {
                    h1 { (title) }
                    (body)
                    p.updated #updated data-live { "Updated " time { (jiff::Timestamp::now().strftime("%Y-%m-%d %H:%M:%S UTC")) } }
                }
            }
        }
    }
}

/// The sign-in form; `error` says why the last attempt failed.
pub fn sign_in(error: Option<&str>) -> Markup {
    layout(
        "Sign in",
        None,
        None,
        html! {
            @if let Some(error) = error {
                p.banner.error role="alert" { (error) }
            }
            form.signin method="post" action="/signin" {
                label for="token" { "API token" }
                input #token type="password" name="token" autocomplete="current-password" required;
                p.hint { "The token of the lease API (DISCOVERY_TOKEN or a line of the token file). It is exchanged for a session cookie and never stored in the page." }
                button type="submit" { "Sign in" }
            }
        },
    )
}

fn percent(rate: Option<f64>) -> String {
    match rate {
        Some(r) => format!("{:.0} %", r * 100.0),
        None => "no data".to_owned(),
    }
}

fn badge(rate: Option<f64>) -> Markup {
    let class = match Badge::of(rate) {
        Badge::Good => "badge good",
        Badge::Fair => "badge fair",
        Badge::Poor => "badge poor",
        Badge::None => "badge none",
    };
    html! { span class=(class) { (percent(rate)) } }
}

fn health(healthy: Option<bool>) -> Markup {
    match healthy {
        Some(true) => html! { span.state.up { "healthy" } },
        Some(false) => html! { span.state.down { "unhealthy" } },
        None => html! { span.state.unknown { "not probed" } },
    }
}

fn latency(ms: Option<u64>) -> String {
    ms.map_or_else(|| "—".to_owned(), |ms| format!("{ms} ms"))
}

/// What a failed probe says: the status the probe URL answered, else the failure's kind.
fn failure(f: &LastFailureView) -> String {
    match f.status {
        Some(status) => format!("status {status}"),
        None => f.kind.as_str().to_owned(),
    }
}

/// A row's health: the verdict, then why it is unhealthy (an unhealthy proxy's latency says
/// nothing), else the last latency.
fn health_cell(row: &ProxyRow) -> Markup {
    html! {
        (health(row.healthy)) " "
        @if let Some(f) = &row.last_failure {
            code title=(format!("last failed probe at {}", f.at)) { (failure(f)) }
        } @else {
            (latency(row.latency_ms))
        }
    }
}

fn age(seconds: Option<u64>) -> String {
    match seconds {
        None => "—".to_owned(),
        Some(s) if s < 120 => format!("{s}s"),
        Some(s) if s < 7200 => format!("{}m", s / 60),
        Some(s) if s < 172_800 => format!("{}h", s / 3600),
        Some(s) => format!("{}d", s / 86400),
    }
}

fn at(ms: i64) -> String {
    jiff::Timestamp::from_millisecond(ms)
        .map(|t| t.to_string())
        .unwrap_or_default()
}

/// The fleet page.
pub fn fleet(view: &FleetView, access: Access) -> Markup {
    let p = &view.proxies;
    let l = &view.leases;
    let g = &view.gateway;
    layout(
        "Fleet",
        Some(Section::Fleet),
        Some(access),
        html! {
            section #fleet data-live aria-labelledby="fleet-h" {
                h2 #fleet-h { "Summary" }
                dl.cards {
                    div { dt { "Proxies" } dd { (p.total) } }
                    div { dt { "Healthy" } dd { (p.healthy) } }
                    div { dt { "Unhealthy" } dd { (p.unhealthy) } }
                    div { dt { "Not probed" } dd { (p.unknown) } }
                    div { dt { "Leases ÷ capacity" } dd { (l.active) " ÷ " (l.capacity) } }
                    div { dt { "Cooldowns" } dd { (l.cooldowns) } }
                    div { dt { "Gateway sessions" } dd { (g.sessions) } }
                    div { dt { "Gateway requests/s (5 min)" } dd { (format!("{:.2}", g.requests_per_second)) } }
                    div { dt { "Gateway bans (5 min)" } dd { (g.bans) } }
                }
                h3 { "By phase" }
                table {
                    thead { tr { th scope="col" { "Phase" } th scope="col" { "Proxies" } } }
                    tbody {
                        @for (phase, n) in &p.by_phase {
                            tr { td { (phase) } td { (n) } }
                        }
                    }
                }
            }
            section #pools data-live aria-labelledby="pools-h" {
                h2 #pools-h { "Pools" }
                @if view.pools.is_empty() {
                    p { "No ProxyPools." }
                } @else {
                    table {
                        thead { tr {
                            th scope="col" { "Pool" } th scope="col" { "Replicas" } th scope="col" { "Desired" }
                            th scope="col" { "Ready" } th scope="col" { "Utilisation" } th scope="col" { "Last scale" } th scope="col" { "Why" }
                        } }
                        tbody {
                            @for pool in &view.pools {
                                tr {
                                    td { (pool.pool) }
                                    td { (pool.replicas) }
                                    td { (pool.desired.map_or_else(|| "—".to_owned(), |d| d.to_string())) }
                                    td { (pool.ready) }
                                    td { (pool.utilization.map_or_else(|| "—".to_owned(), |u| format!("{:.0} %", u * 100.0))) }
                                    td { (pool.last_scale_time.as_deref().unwrap_or("—")) }
                                    td { (pool.reason.as_deref().unwrap_or("—")) }
                                }
                            }
                        }
                    }
                }
            }
            @if view.tenants.iter().any(|t| t.name != crate::ledger::DEFAULT_TENANT) {
                section #tenants data-live aria-labelledby="tenants-h" {
                    h2 #tenants-h { "Tenants" }
                    table {
                        thead { tr {
                            th scope="col" { "Tenant" } th scope="col" { "Scope" }
                            th scope="col" { "Leases ÷ quota" } th scope="col" { "Sessions ÷ quota" }
                            th scope="col" { "Acquires/s (burst)" }
                        } }
                        tbody {
                            @for tenant in &view.tenants {
                                tr data-tenant=(tenant.name) {
                                    td { (tenant.name) }
                                    td { (tenant.scope) }
                                    td { (tenant.leases) " ÷ " (quota(tenant.lease_quota)) }
                                    td { (tenant.sessions) " ÷ " (quota(tenant.session_quota)) }
                                    td {
                                        @match (tenant.acquires_per_second, tenant.burst) {
                                            (Some(rate), Some(burst)) => { (rate) " (" (burst) ")" }
                                            _ => { "—" }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}

/// A quota as shown: its number, or `∞` without one.
fn quota(limit: Option<u32>) -> String {
    limit.map_or_else(|| "∞".to_owned(), |n| n.to_string())
}

/// The link that sorts the proxies table by `key`, keeping the filter.
fn sort_link(filter: &ProxiesFilter, key: SortKey, label: &str) -> Markup {
    let (order, mark) = match (filter.sort == key, filter.order) {
        (true, Order::Asc) => (Order::Desc, Some("ascending")),
        (true, Order::Desc) => (Order::Asc, Some("descending")),
        (false, _) => (Order::Asc, None),
    };
    let href = proxies_href(filter, key, order, 1);
    html! {
        th scope="col" aria-sort=[mark] {
            a href=(href) { (label) @if let Some(mark) = mark { span.sorted { (if mark == "ascending" { " ▲" } else { " ▼" }) } } }
        }
    }
}

fn name_of<T: serde::Serialize>(value: T) -> String {
    serde_json::to_value(value)
        .ok()
        .and_then(|v| v.as_str().map(str::to_owned))
        .unwrap_or_default()
}

fn proxies_href(filter: &ProxiesFilter, sort: SortKey, order: Order, page: u32) -> String {
    let mut query = url_params(&[
        ("name", filter.name()),
        ("label", filter.label()),
        ("exit", filter.exit()),
        ("sort", &name_of(sort)),
        ("order", &name_of(order)),
    ]);
    if page > 1 {
        query.push_str(&format!("&page={page}"));
    }
    format!("/proxies?{query}")
}

fn url_params(pairs: &[(&str, &str)]) -> String {
    let encoded: Vec<String> = pairs
        .iter()
        .filter(|(_, v)| !v.is_empty())
        .map(|(k, v)| format!("{k}={}", encode(v)))
        .collect();
    encoded.join("&")
}

/// Percent-encodes a query value (everything but unreserved characters).
fn encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn proxy_href(row: &ProxyRow) -> String {
    format!("/proxies/{}/{}", encode(&row.namespace), encode(&row.name))
}

/// A proxy's exit in one cell: the address, its country and network, and a flag when it is
/// shared or sampled.
fn exit_cell(exit: Option<&ExitRow>) -> Markup {
    let Some(exit) = exit else {
        return html! { "—" };
    };
    html! {
        code { (exit.ip) }
        @if let Some(country) = &exit.country { " " (country) }
        @if let Some(asn) = exit.asn { " AS" (asn) }
        @if !exit.shared_with.is_empty() { " " span.flag title=(format!("also {}", exit.shared_with.join(", "))) { "shared" } }
        @if exit.sampled { " " span.flag { "sampled" } }
        @if let Some(mismatch) = &exit.geo_mismatch { " " span.flag title=(mismatch) { "geo mismatch" } }
    }
}

/// The proxies page.
pub fn proxies(view: &ProxiesView, filter: &ProxiesFilter, access: Access) -> Markup {
    layout(
        "Proxies",
        Some(Section::Proxies),
        Some(access),
        html! {
            form.filter method="get" action="/proxies" role="search" {
                label for="name" { "Name contains" }
                input #name type="search" name="name" value=(filter.name());
                label for="label" { "Labels" }
                input #label type="search" name="label" value=(filter.label()) placeholder="geo=eu,tier=a";
                label for="exit" { "Exit" }
                input #exit type="search" name="exit" value=(filter.exit()) placeholder="address, country or shared";
                input type="hidden" name="sort" value=(name_of(filter.sort));
                input type="hidden" name="order" value=(name_of(filter.order));
                button type="submit" { "Filter" }
            }
            section #proxies data-live aria-labelledby="proxies-h" {
                h2 #proxies-h { (view.matched) " of " (view.total) " proxies" }
                table #proxy-table {
                    thead { tr {
                        (sort_link(filter, SortKey::Name, "Proxy"))
                        th scope="col" { "Mode" }
                        th scope="col" { "Endpoint" }
                        th scope="col" { "Exit" }
                        (sort_link(filter, SortKey::Phase, "Phase"))
                        (sort_link(filter, SortKey::Latency, "Health"))
                        (sort_link(filter, SortKey::Leases, "Leases"))
                        th scope="col" { "Flags" }
                        th scope="col" { "Cooldowns" }
                        (sort_link(filter, SortKey::Success, "Success (1 h)"))
                        (sort_link(filter, SortKey::Age, "Age"))
                    } }
                    tbody {
                        @for row in &view.proxies {
                            tr data-proxy=(format!("{}/{}", row.namespace, row.name)) {
                                td { a href=(proxy_href(row)) { (row.namespace) "/" (row.name) } }
                                td { (row.mode) @if let Some(p) = &row.provider { " (" (p) ")" } }
                                td { (row.endpoint.as_deref().unwrap_or("—")) }
                                td.exit { (exit_cell(row.exit.as_ref())) }
                                td.phase { (row.phase) }
                                td.health { (health_cell(row)) }
                                td { (row.active_leases) " ÷ " (row.max_leases) }
                                td { @if row.cordoned { span.flag { "cordoned" } } " " @if row.draining { span.flag { "draining" } } }
                                td { (row.cooldowns) }
                                td { (badge(row.success_rate)) }
                                td { (age(row.age_seconds)) }
                            }
                        }
                    }
                }
                @if view.pages > 1 {
                    nav.pages aria-label="Pages" {
                        @if view.page > 1 {
                            a rel="prev" href=(proxies_href(filter, filter.sort, filter.order, view.page - 1)) { "Previous" }
                        }
                        span { "Page " (view.page) " of " (view.pages) }
                        @if view.page < view.pages {
                            a rel="next" href=(proxies_href(filter, filter.sort, filter.order, view.page + 1)) { "Next" }
                        }
                    }
                }
            }
        },
    )
}

/// The per-target page.
pub fn targets(view: &TargetsView, access: Access) -> Markup {
    layout(
        "Targets",
        Some(Section::Targets),
        Some(access),
        html! {
            section #targets data-live aria-labelledby="targets-h" {
                h2 #targets-h { "The last hour" }
                @if view.targets.is_empty() {
                    p { "No leases, reports or cooldowns for any target in the last hour." }
                } @else {
                    table #target-table {
                        thead { tr {
                            th scope="col" { "Target" } th scope="col" { "Leases" }
                            th scope="col" { "OK" } th scope="col" { "Rate-limited" } th scope="col" { "Blocked" } th scope="col" { "Error" }
                            th scope="col" { "Requests" } th scope="col" { "Success" } th scope="col" { "Cooling down until" }
                        } }
                        tbody {
                            @for row in &view.targets {
                                tr data-target=(row.target) {
                                    td { (row.target) }
                                    td { (row.leases) }
                                    td { (row.reports.ok) }
                                    td { (row.reports.rate_limited) }
                                    td { (row.reports.blocked) }
                                    td { (row.reports.error) }
                                    td { (row.outcomes.total()) }
                                    td { (badge(row.success_rate)) }
                                    td.cooling {
                                        @if row.cooling.is_empty() { "—" }
                                        ul {
                                            @for c in &row.cooling {
                                                li { (c.namespace) "/" (c.name) " " (c.result) " until " time { (c.until) } }
                                            }
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        },
    )
}

fn spend_table(id: &str, caption: &str, first: &str, rows: &[SpendRow], currency: &str) -> Markup {
    let money = |amount: f64| format!("{} {currency}", format_money(amount));
    html! {
        @if !rows.is_empty() {
            table id=(id) {
                caption { (caption) }
                thead { tr {
                    th scope="col" { (first) } th scope="col" { "Bytes" }
                    th scope="col" { "Per GB" } th scope="col" { "Per hour" } th scope="col" { "Spend" }
                } }
                tbody {
                    @for row in rows {
                        tr {
                            td { (row.name) }
                            td { (format_bytes(row.bytes as f64)) }
                            td { (money(row.bytes_spend)) }
                            td { (money(row.hours_spend)) }
                            td { (money(row.spend)) }
                        }
                    }
                }
            }
        }
    }
}

fn spend_window(id: &str, heading: &str, window: &SpendWindow, currency: &str) -> Markup {
    let heading_id = format!("{id}-h");
    html! {
        section aria-labelledby=(heading_id) {
            h2 id=(heading_id) { (heading) " (since " time { (at(window.since_ms)) } ")" }
            p { "Spent " strong { (format_money(window.total)) " " (currency) } " on " (format_bytes(window.bytes as f64)) " relayed." }
            @if window.tenants.is_empty() && window.proxies.is_empty() {
                p { "Nothing relayed or priced in this window." }
            }
            (spend_table(&format!("{id}-tenants"), "Per tenant (per GB only)", "Tenant", &window.tenants, currency))
            (spend_table(&format!("{id}-pools"), "Per ProxyPool", "Pool", &window.pools, currency))
            (spend_table(&format!("{id}-proxies"), "Per proxy (the costliest 100)", "Proxy", &window.proxies, currency))
        }
    }
}

/// The three charts of one tenant or target.
fn series_charts(kind: &str, index: usize, series: &ChartSeries, view: &ChartsView) -> Markup {
    let bytes: Vec<Option<f64>> = series.bytes.iter().map(|b| Some(*b as f64)).collect();
    let spend: Vec<Option<f64>> = series.spend.iter().map(|s| Some(*s)).collect();
    let bytes_title = format!("Bytes per hour: {}", series.name);
    let spend_title = format!("Spend per hour: {}", series.name);
    let rate_title = format!("Success rate per minute: {}", series.name);
    let hourly = |id: String, title: &str, unit, values: &[Option<f64>]| {
        chart::chart(&Chart {
            id: &id,
            title,
            unit,
            style: Style::Bars,
            from_ms: view.hours_from_ms,
            step_ms: HOUR_MS,
            values,
        })
    };
    html! {
        h3 { (series.name) }
        div.charts {
            (hourly(format!("{kind}-{index}-bytes"), &bytes_title, Unit::Bytes, &bytes))
            (hourly(format!("{kind}-{index}-spend"), &spend_title, Unit::Money(&view.currency), &spend))
            @if let Some(rates) = &series.success_rate {
                (chart::chart(&Chart {
                    id: &format!("{kind}-{index}-rate"),
                    title: &rate_title,
                    unit: Unit::Rate,
                    style: Style::Line,
                    from_ms: view.minutes_from_ms,
                    step_ms: 60_000,
                    values: rates,
                }))
            }
        }
    }
}

/// The spend page: spend over the hour and the day, and the charts per tenant and target.
pub fn spend(view: &SpendView, charts: &ChartsView, access: Access) -> Markup {
    layout(
        "Spend",
        Some(Section::Spend),
        Some(access),
        html! {
            p.hint { "Bytes relayed by the gateway × each proxy's spec.cost.perGB, plus perHour × the time each proxy existed, in " (view.currency) " (--cost-currency). A tenant's spend is per GB only: a proxy's hours are paid whoever uses it." }
            div #spend data-live {
                (spend_window("hour", "This hour", &view.hour, &view.currency))
                (spend_window("day", "The last 24 hours", &view.day, &view.currency))
            }
            section #tenant-charts aria-labelledby="tenant-charts-h" {
                h2 #tenant-charts-h { "Per tenant, over time" }
                p.hint { "Bytes and spend per hour over the last 24 hours, success rate per minute over the last hour (this replica's)." }
                @if charts.tenants.is_empty() { p { "No tenant." } }
                @for (i, series) in charts.tenants.iter().enumerate() {
                    (series_charts("tenant", i, series, charts))
                }
            }
            section #target-charts aria-labelledby="target-charts-h" {
                h2 #target-charts-h { "Per target, over time (the busiest 10 of the day)" }
                @if charts.targets.is_empty() { p { "Nothing relayed to any target in the last 24 hours." } }
                @for (i, series) in charts.targets.iter().enumerate() {
                    (series_charts("target", i, series, charts))
                }
            }
        },
    )
}

fn events_table(id: &str, events: &[crate::ledger::EventEntry]) -> Markup {
    html! {
        @if events.is_empty() {
            p { "No lease events." }
        } @else {
            table id=(id) {
                thead { tr {
                    th scope="col" { "At" } th scope="col" { "Event" } th scope="col" { "Proxy" }
                    th scope="col" { "Target" } th scope="col" { "Detail" } th scope="col" { "Lease" }
                } }
                tbody {
                    @for e in events {
                        tr {
                            td { time { (at(e.at_ms)) } }
                            td { (e.kind) }
                            td { (e.namespace) "/" (e.name) }
                            td { (e.target.as_deref().unwrap_or("—")) }
                            td { (e.result.as_deref().or(e.reason.as_deref()).or(e.client.as_deref()).unwrap_or("")) }
                            td { code { (e.lease_id) } }
                        }
                    }
                }
            }
        }
    }
}

/// The lease events page.
pub fn events(view: &EventsView, access: Access) -> Markup {
    layout(
        "Lease events",
        Some(Section::Events),
        Some(access),
        html! {
            section #events data-live aria-labelledby="events-h" {
                h2 #events-h { "The newest " (view.events.len()) }
                (events_table("event-table", &view.events))
            }
        },
    )
}

/// One proxy's page.
pub fn proxy(view: &ProxyDetail, access: Access) -> Markup {
    let row = &view.proxy;
    let title = format!("{}/{}", row.namespace, row.name);
    layout(
        &title,
        Some(Section::Proxies),
        Some(access),
        html! {
            section #summary data-live aria-labelledby="summary-h" {
                h2 #summary-h { "Summary" }
                dl.cards {
                    div { dt { "Phase" } dd { (row.phase) } }
                    div { dt { "Health" } dd { (health(row.healthy)) } }
                    div { dt { "Last latency" } dd { (latency(row.latency_ms)) } }
                    @if let Some(f) = &row.last_failure {
                        div { dt { "Last failure" } dd { code { (failure(f)) } " at " (f.at) } }
                    }
                    div { dt { "Last probe" } dd { (view.probe.last_probe.as_deref().unwrap_or("—")) } }
                    div { dt { "Leases" } dd { (row.active_leases) " ÷ " (row.max_leases) } }
                    div { dt { "Success (1 h)" } dd { (badge(row.success_rate)) } }
                    div { dt { "Endpoint" } dd { (row.endpoint.as_deref().unwrap_or("—")) } }
                    div { dt { "Mode" } dd { (row.mode) @if let Some(p) = &row.provider { " (" (p) ")" } } }
                }
                @if let Some(error) = &view.probe.last_error {
                    p { "Last probe error: " code { (error) } }
                }
                @if !view.labels.is_empty() {
                    p { "Labels: " @for (k, v) in &view.labels { code { (k) "=" (v) } " " } }
                }
            }
            section #exit data-live aria-labelledby="exit-h" {
                h2 #exit-h { "Exit" }
                @if let Some(exit) = &row.exit {
                    dl.cards {
                        div { dt { "Exit address" } dd { code { (exit.ip) } @if exit.sampled { " (sampled)" } } }
                        div { dt { "Changed" } dd { (exit.changed_at.as_deref().unwrap_or("—")) } }
                        div { dt { "Country" } dd { (exit.country.as_deref().unwrap_or("—")) } }
                        div { dt { "Network" } dd {
                            @if let Some(asn) = exit.asn { "AS" (asn) " " }
                            (exit.organization.as_deref().unwrap_or(""))
                        } }
                        div { dt { "Shared with" } dd { @if exit.shared_with.is_empty() { "—" } @else { (exit.shared_with.join(", ")) } } }
                        @if let Some(mismatch) = &exit.geo_mismatch { div { dt { "Geo mismatch" } dd { (mismatch) } } }
                        div { dt { "Last check" } dd { (exit.checked_at) } }
                    }
                    @if let Some(error) = &exit.last_error {
                        p { "Last exit check error: " code { (error) } }
                    }
                } @else {
                    p { "No exit known (no exit check, or no answer yet)." }
                }
                @if !view.exit_changes.is_empty() {
                    table #exit-changes {
                        caption { "Exit changes, newest first" }
                        thead { tr { th scope="col" { "When" } th scope="col" { "From" } th scope="col" { "To" } th scope="col" { "Country" } th scope="col" { "ASN" } } }
                        tbody {
                            @for c in &view.exit_changes {
                                tr {
                                    td { time { (at(c.at_ms)) } }
                                    td { (c.previous_ip.as_deref().unwrap_or("—")) }
                                    td { code { (c.exit_ip) } }
                                    td { (c.country.as_deref().unwrap_or("—")) }
                                    td { @if let Some(asn) = c.asn { (asn) } @else { "—" } }
                                }
                            }
                        }
                    }
                }
            }
            section #conditions data-live aria-labelledby="conditions-h" {
                h2 #conditions-h { "Conditions" }
                @if view.conditions.is_empty() {
                    p { "No conditions (standalone mode, or not reconciled yet)." }
                } @else {
                    table {
                        thead { tr { th scope="col" { "Type" } th scope="col" { "Status" } th scope="col" { "Reason" } th scope="col" { "Message" } th scope="col" { "Since" } } }
                        tbody {
                            @for c in &view.conditions {
                                tr { td { (c.type_) } td { (c.status) } td { (c.reason) } td { (c.message) } td { time { (c.last_transition_time) } } }
                            }
                        }
                    }
                }
            }
            section #kube-events data-live aria-labelledby="kube-events-h" {
                h2 #kube-events-h { "Events" }
                @if view.events.is_empty() {
                    p { "No Kubernetes Events (none recorded, or standalone mode)." }
                } @else {
                    table {
                        thead { tr { th scope="col" { "Type" } th scope="col" { "Reason" } th scope="col" { "Message" } th scope="col" { "Count" } th scope="col" { "Last seen" } } }
                        tbody {
                            @for e in &view.events {
                                tr { td { (e.type_) } td { (e.reason) } td { (e.message) } td { (e.count) } td { (e.last_seen.as_deref().unwrap_or("—")) } }
                            }
                        }
                    }
                }
            }
            section #leases data-live aria-labelledby="leases-h" {
                h2 #leases-h { "Lease events" }
                (events_table("proxy-event-table", &view.lease_events))
            }
        },
    )
}

/// A page for an error a person can act on (unknown proxy, bad filter).
pub fn problem(title: &str, message: &str, access: Access) -> Markup {
    layout(
        title,
        None,
        Some(access),
        html! {
            p.banner.error role="alert" { (message) }
            p { a href="/" { "Back to the fleet" } }
        },
    )
}
