//! Requests offered at a fixed rate, whatever the server does (an open loop, as wrk2 offers
//! load): each connection sends its requests on a schedule, and a request's latency counts
//! from when it was due, so a server that stalls is charged for every request that waited
//! behind the stall, not only for the one in flight (what a closed loop such as wrk
//! under-reports: "coordinated omission").
//!
//! Two kinds of work: lease pairs ([`pairs`]), an acquire (`POST /v1/leases`) and the release
//! of the lease it got (`DELETE`), the acquire due at its slot and the release when the
//! acquire's answer arrived; and plain-HTTP GETs, through a forward proxy ([`gets`]) or
//! straight to a server ([`floor`]: the HTTP floor a route's latency is held against).

use std::time::{Duration, Instant};

/// What an open-loop run saw.
#[derive(Debug, Default, Clone)]
pub struct OpenLoopResult {
    /// Units (pairs, or GETs) offered per second.
    pub offered: f64,
    /// Units completed.
    pub pairs: u64,
    /// Requests answered with anything but the expected status (201 / 204, or 200), or not
    /// answered.
    pub errors: u64,
    /// The first of those, for the report.
    pub first_error: Option<String>,
    /// Every request's latency from when it was due, in microseconds, sorted.
    pub latencies_us: Vec<u64>,
    /// How long the run took.
    pub elapsed: Duration,
}

impl OpenLoopResult {
    /// The latency at quantile `q` (0.5, 0.99, 0.999, 1.0).
    pub fn quantile(&self, q: f64) -> Duration {
        if self.latencies_us.is_empty() {
            return Duration::ZERO;
        }
        let last = self.latencies_us.len() - 1;
        let index = ((last as f64) * q).ceil() as usize;
        Duration::from_micros(self.latencies_us[index.min(last)])
    }

    /// Units completed per second.
    pub fn achieved(&self) -> f64 {
        self.pairs as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// What one connection saw.
#[derive(Default)]
struct Lane {
    pairs: u64,
    errors: u64,
    first_error: Option<String>,
    latencies_us: Vec<u64>,
}

impl Lane {
    fn failed(&mut self, what: String) {
        self.errors += 1;
        self.first_error.get_or_insert(what);
    }
}

/// What each connection does at its slots.
#[derive(Debug, Clone)]
enum Work {
    /// Acquire+release pairs on the lease API at `api`, with `token` and the acquire `body`.
    Pairs {
        api: String,
        token: String,
        body: String,
    },
    /// A GET of `url`, through the forward proxy `proxy` (credentials in its user part) when
    /// there is one.
    Gets { proxy: Option<String>, url: String },
}

/// Offers `pairs_per_s` acquire+release pairs to the lease API at `api` for `duration`, over
/// `connections` keep-alive connections (each its own client), with `token` and the acquire
/// body `body`.
pub async fn pairs(
    api: &str,
    token: &str,
    body: &str,
    connections: usize,
    pairs_per_s: f64,
    duration: Duration,
) -> OpenLoopResult {
    let work = Work::Pairs {
        api: api.to_owned(),
        token: token.to_owned(),
        body: body.to_owned(),
    };
    offer(work, connections, pairs_per_s, duration).await
}

/// Offers `gets_per_s` GETs of `url` through the forward proxy `proxy` (an `http://user:pass@`
/// URL) for `duration`, over `connections` keep-alive connections; a GET counts when
/// answered 200.
pub async fn gets(
    proxy: &str,
    url: &str,
    connections: usize,
    gets_per_s: f64,
    duration: Duration,
) -> OpenLoopResult {
    let work = Work::Gets {
        proxy: Some(proxy.to_owned()),
        url: url.to_owned(),
    };
    offer(work, connections, gets_per_s, duration).await
}

/// Offers `gets_per_s` GETs of `url` straight to its server for `duration`, over
/// `connections` keep-alive connections; a GET counts when answered 200.
pub async fn floor(
    url: &str,
    connections: usize,
    gets_per_s: f64,
    duration: Duration,
) -> OpenLoopResult {
    let work = Work::Gets {
        proxy: None,
        url: url.to_owned(),
    };
    offer(work, connections, gets_per_s, duration).await
}

async fn offer(work: Work, connections: usize, per_s: f64, duration: Duration) -> OpenLoopResult {
    let interval = Duration::from_secs_f64(connections as f64 / per_s);
    let started = Instant::now() + Duration::from_millis(100);
    let lanes: Vec<_> = (0..connections)
        .map(|i| {
            let offset = interval.mul_f64(i as f64 / connections as f64);
            tokio::spawn(lane(
                work.clone(),
                started + offset,
                interval,
                started + duration,
            ))
        })
        .collect();
    let mut result = OpenLoopResult {
        offered: per_s,
        ..OpenLoopResult::default()
    };
    for lane in lanes {
        let lane = lane.await.unwrap_or_default();
        result.pairs += lane.pairs;
        result.errors += lane.errors;
        if result.first_error.is_none() {
            result.first_error = lane.first_error;
        }
        result.latencies_us.extend(lane.latencies_us);
    }
    result.elapsed = started.elapsed();
    result.latencies_us.sort_unstable();
    result
}

/// One connection's work, the first due at `first`, then one every `interval`, until `end`.
async fn lane(work: Work, first: Instant, interval: Duration, end: Instant) -> Lane {
    let mut lane = Lane::default();
    let mut builder = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .timeout(Duration::from_secs(10));
    if let Work::Gets {
        proxy: Some(proxy), ..
    } = &work
    {
        match reqwest::Proxy::http(proxy) {
            Ok(proxy) => builder = builder.proxy(proxy),
            Err(e) => {
                lane.failed(format!("proxy {proxy}: {e}"));
                return lane;
            }
        }
    }
    let Ok(http) = builder.build() else {
        lane.failed("cannot build a client".into());
        return lane;
    };
    let mut due = first;
    while due < end {
        tokio::time::sleep_until(due.into()).await;
        match &work {
            Work::Pairs { api, token, body } => pair(&http, api, token, body, due, &mut lane).await,
            Work::Gets { url, .. } => get(&http, url, due, &mut lane).await,
        }
        due += interval;
    }
    lane
}

/// One acquire due at `due`, and the release of its lease.
async fn pair(
    http: &reqwest::Client,
    api: &str,
    token: &str,
    body: &str,
    due: Instant,
    lane: &mut Lane,
) {
    let acquired = http
        .post(format!("{api}/v1/leases"))
        .bearer_auth(token)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .body(body.to_owned())
        .send()
        .await;
    let lease_id = match acquired {
        Ok(answer) if answer.status() == reqwest::StatusCode::CREATED => answer
            .json::<serde_json::Value>()
            .await
            .ok()
            .and_then(|lease| lease["leaseID"].as_str().map(str::to_owned)),
        Ok(answer) => {
            lane.failed(format!("acquire answered {}", answer.status()));
            None
        }
        Err(e) => {
            lane.failed(format!("acquire: {e}"));
            None
        }
    };
    let answered = Instant::now();
    lane.latencies_us.push(micros(answered - due));
    if let Some(id) = lease_id {
        let released = http
            .delete(format!("{api}/v1/leases/{id}"))
            .bearer_auth(token)
            .send()
            .await;
        lane.latencies_us.push(micros(answered.elapsed()));
        match released {
            Ok(answer) if answer.status() == reqwest::StatusCode::NO_CONTENT => {
                lane.pairs += 1;
            }
            Ok(answer) => lane.failed(format!("release answered {}", answer.status())),
            Err(e) => lane.failed(format!("release: {e}")),
        }
    }
}

/// One GET due at `due`, its body read whole.
async fn get(http: &reqwest::Client, url: &str, due: Instant, lane: &mut Lane) {
    let answer = http.get(url).send().await;
    let outcome = match answer {
        Ok(answer) if answer.status() == reqwest::StatusCode::OK => answer
            .bytes()
            .await
            .map(|_| ())
            .map_err(|e| format!("body: {e}")),
        Ok(answer) => Err(format!("GET answered {}", answer.status())),
        Err(e) => Err(format!("GET: {e}")),
    };
    lane.latencies_us.push(micros(due.elapsed()));
    match outcome {
        Ok(()) => lane.pairs += 1,
        Err(what) => lane.failed(what),
    }
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
