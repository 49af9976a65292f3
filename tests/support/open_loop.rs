//! Lease pairs offered at a fixed rate, whatever the server does (an open loop, as wrk2
//! offers load): each connection sends its pairs on a schedule, and a request's latency counts
//! from when it was due, so a server that stalls is charged for every request that waited
//! behind the stall, not only for the one in flight (what a closed loop such as wrk
//! under-reports: "coordinated omission").
//!
//! A pair is an acquire (`POST /v1/leases`) and the release of the lease it got (`DELETE`).
//! The acquire is due at its slot; the release is due when the acquire's answer arrived.

use std::time::{Duration, Instant};

/// What an open-loop run saw.
#[derive(Debug, Default, Clone)]
pub struct OpenLoopResult {
    /// Pairs offered per second.
    pub offered: f64,
    /// Pairs completed.
    pub pairs: u64,
    /// Requests answered with anything but 201 / 204, or not answered.
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

    /// Pairs completed per second.
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
    let interval = Duration::from_secs_f64(connections as f64 / pairs_per_s);
    let started = Instant::now() + Duration::from_millis(100);
    let lanes: Vec<_> = (0..connections)
        .map(|i| {
            let offset = interval.mul_f64(i as f64 / connections as f64);
            let (api, token, body) = (api.to_owned(), token.to_owned(), body.to_owned());
            tokio::spawn(lane(
                api,
                token,
                body,
                started + offset,
                interval,
                started + duration,
            ))
        })
        .collect();
    let mut result = OpenLoopResult {
        offered: pairs_per_s,
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

/// One connection's pairs, the first due at `first`, then one every `interval`, until `end`.
async fn lane(
    api: String,
    token: String,
    body: String,
    first: Instant,
    interval: Duration,
    end: Instant,
) -> Lane {
    let mut lane = Lane::default();
    let Ok(http) = reqwest::Client::builder()
        .pool_max_idle_per_host(1)
        .timeout(Duration::from_secs(10))
        .build()
    else {
        lane.failed("cannot build a client".into());
        return lane;
    };
    let acquire_url = format!("{api}/v1/leases");
    let mut due = first;
    while due < end {
        tokio::time::sleep_until(due.into()).await;
        let acquired = http
            .post(&acquire_url)
            .bearer_auth(&token)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.clone())
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
                .bearer_auth(&token)
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
        due += interval;
    }
    lane
}

fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}
