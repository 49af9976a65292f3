//! ProxyPools end to end on a real Kubernetes API server: the `proxy-operator run` binary with
//! the RBAC of `manifests/`, the CRDs from `crd/`, and the test kubelet running each member's
//! squid Pod with real squid.

use crate::support;

use std::collections::BTreeMap;
use std::time::Duration;

use kube::ResourceExt;
use kube::api::{DeleteParams, ListParams, Patch, PatchParams, PostParams};
use proxy_operator::resources::pool::{POOL_LABEL, TEMPLATE_HASH_LABEL};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};
use support::operator::{OperatorProcess, lease_id, metric_sum};
use support::pools::pool_object;
use support::world::{SLOW, World, eventually, refusal, within};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_crd_rules_and_defaults_are_enforced_by_the_server() {
    let Some(world) = World::new("pool-crd").await else {
        return;
    };
    let template = world.pool_template("eu", 5);
    let refused = |name: &str, spec: Value| {
        let api = world.raw_pools();
        let object = pool_object(name, spec);
        async move { refusal(api.create(&PostParams::default(), &object).await) }
    };
    for (name, spec, expected) in [
        (
            "external",
            json!({"template": {"spec": {"mode": "External",
                "endpoint": {"host": "127.0.0.1", "port": 3128}}}}),
            "template.spec.mode must be Managed",
        ),
        (
            "no-surge-no-unavailable",
            json!({"template": template, "strategy": {"maxSurge": 0, "maxUnavailable": "0%"}}),
            "must not both be 0",
        ),
        (
            "bad-percent",
            json!({"template": template, "strategy": {"maxSurge": "150%"}}),
            "percentage",
        ),
        (
            "min-above-max",
            json!({"template": template, "autoscaling": {"minReplicas": 3, "maxReplicas": 2}}),
            "minReplicas must not be above maxReplicas",
        ),
        (
            "reserved-label",
            json!({"template": {"metadata": {"labels": {POOL_LABEL: "x"}}, "spec": template["spec"]}}),
            "operator sets them",
        ),
        (
            "negative",
            json!({"template": template, "replicas": -1}),
            "replicas",
        ),
    ] {
        let message = refused(name, spec).await;
        assert!(
            message.contains(expected),
            "{name}: refusal {message:?} does not mention {expected:?}"
        );
    }

    // Defaults, filled by the server.
    let created = world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                "defaults",
                json!({"template": template, "autoscaling": {"maxReplicas": 4}}),
            ),
        )
        .await
        .expect("a valid pool");
    let spec = &serde_json::to_value(&created).unwrap()["spec"];
    assert_eq!(spec["replicas"], 1, "{spec}");
    assert_eq!(
        spec["strategy"],
        json!({"maxSurge": 1, "maxUnavailable": 0}),
        "{spec}"
    );
    assert_eq!(spec["autoscaling"]["minReplicas"], 1, "{spec}");
    assert_eq!(spec["autoscaling"]["targetUtilization"], 0.7, "{spec}");
    assert_eq!(spec["autoscaling"]["scaleDownAfter"], "600s", "{spec}");
    assert_eq!(spec["autoscaling"]["wakeTimeout"], "60s", "{spec}");
    assert_eq!(
        spec["template"]["spec"]["healthCheck"]["failureThreshold"], 2,
        "{spec}"
    );

    // A template's provider may change (a roll-out), unlike a Proxy's.
    let mut changed = template.clone();
    changed["spec"]["provider"] = json!("other");
    world
        .raw_pools()
        .patch(
            "defaults",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"template": changed}})),
        )
        .await
        .expect("a template's provider may change");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pool_scales_through_scale_drains_what_it_removes_and_rolls_within_its_surge() {
    let Some(world) = World::new("pool-scale").await else {
        return;
    };
    // Room in the replacement budget for the three removals at once.
    let operator = world.operator(&["--replacement-budget", "3"]).await;
    world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                "eu",
                json!({"replicas": 3, "template": world.pool_template("eu", 5)}),
            ),
        )
        .await
        .expect("create the pool");
    let three = world.wait_pool_settled("eu", 3, SLOW).await;
    let pool = world.pools().get("eu").await.unwrap();
    let status = pool.status.clone().unwrap();
    assert_eq!(status.selector, format!("{POOL_LABEL}=eu"));
    for member in three.values() {
        let owner = &member.owner_references()[0];
        assert_eq!(
            (owner.kind.as_str(), owner.name.as_str()),
            ("ProxyPool", "eu")
        );
        assert_eq!(member.labels().get("geo").map(String::as_str), Some("eu"));
        assert!(member.labels().contains_key(TEMPLATE_HASH_LABEL));
    }

    // `kubectl scale` goes through /scale (the client's patch of /scale without kubectl).
    let kubeconfig = world.admin_kubeconfig();
    if world
        .kubectl(&kubeconfig, &["scale", "proxypool/eu", "--replicas=5"])
        .is_none()
    {
        world
            .pools()
            .patch_scale(
                "eu",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"replicas": 5}})),
            )
            .await
            .expect("scale the pool");
    }
    let five = world.wait_pool_settled("eu", 5, SLOW).await;
    assert!(
        three.keys().all(|name| five.contains_key(name)),
        "scaling up kept every member"
    );
    let scale: Value = world
        .kubectl(
            &kubeconfig,
            &[
                "get",
                "--raw",
                &format!(
                    "/apis/crawl.example.com/v1alpha1/namespaces/{}/proxypools/eu/scale",
                    world.ns
                ),
            ],
        )
        .map_or(
            json!({"status": {"replicas": 5, "selector": format!("{POOL_LABEL}=eu")}}),
            |text| serde_json::from_str(&text).expect("a Scale"),
        );
    assert_eq!(scale["status"]["replicas"], 5, "{scale}");
    assert_eq!(
        scale["status"]["selector"],
        format!("{POOL_LABEL}=eu"),
        "{scale}"
    );

    // Seven leases: one on each member, then two more on two of them.
    let mut leases: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for _ in 0..7 {
        let lease = operator
            .acquire_retrying(
                &json!({"selector": {"geo": "eu"}, "ttlSeconds": 600}),
                "a lease on the pool",
            )
            .await;
        let proxy = lease["proxy"]["name"].as_str().unwrap().to_owned();
        leases.entry(proxy).or_default().push(lease_id(&lease));
    }
    assert_eq!(leases.len(), 5, "least loaded first: {leases:?}");
    let kept: Vec<String> = leases
        .iter()
        .filter(|(_, l)| l.len() == 2)
        .map(|(p, _)| p.clone())
        .collect();
    assert_eq!(kept.len(), 2, "{leases:?}");

    // Down to 2: the three with one lease each go; they drain first.
    world
        .pools()
        .patch_scale(
            "eu",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"replicas": 2}})),
        )
        .await
        .expect("scale the pool down");
    let removed: Vec<String> = leases
        .keys()
        .filter(|p| !kept.contains(p))
        .cloned()
        .collect();
    eventually("the three members with fewest leases draining", || async {
        let all = world.members("eu").await;
        removed
            .iter()
            .all(|name| {
                all.get(name)
                    .is_some_and(|p| p.metadata.deletion_timestamp.is_some())
            })
            .then_some(())
    })
    .await;
    // Their machines stay while their leases run: a Pod is never deleted under a lease.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let all = world.members("eu").await;
    for name in &removed {
        let member = all
            .get(name)
            .unwrap_or_else(|| panic!("{name} went with a lease on it"));
        let proxy = serde_json::to_value(member).unwrap();
        let pod = world.pod_of(&proxy).await;
        assert!(
            pod.is_some_and(|p| p.metadata.deletion_timestamp.is_none()),
            "{name}'s Pod went under a lease"
        );
    }
    for name in &removed {
        for id in &leases[name] {
            operator.release(id).await;
        }
    }
    let two = world.wait_pool_settled("eu", 2, SLOW).await;
    assert_eq!(
        two.keys().cloned().collect::<Vec<_>>(),
        kept,
        "the members with most leases stay"
    );
    for name in &kept {
        for id in &leases[name] {
            let (status, body) = operator.renew(id, 600).await;
            assert_eq!(
                status,
                StatusCode::OK,
                "a kept member's lease survives: {body}"
            );
        }
    }
    for name in &kept {
        for id in &leases[name] {
            operator.release(id).await;
        }
    }

    // A template change rolls every member, never more than maxSurge above replicas.
    let old_hash = two.values().next().unwrap().labels()[TEMPLATE_HASH_LABEL].clone();
    world
        .pools()
        .patch(
            "eu",
            &PatchParams::default(),
            &Patch::Merge(
                json!({"spec": {"template": {"metadata": {"annotations": {"rev": "2"}}}}}),
            ),
        )
        .await
        .expect("change the template");
    let old_hash = &old_hash;
    let most = within(support::world::SLOW, "the roll-out to finish", || {
        let world = &world;
        async move {
            let all = world.members("eu").await;
            let rolled = all.len() == 2
                && all.values().all(|p| {
                    &p.labels()[TEMPLATE_HASH_LABEL] != old_hash
                        && p.status.as_ref().and_then(|s| s.phase)
                            == Some(proxy_operator::resources::proxy::Phase::Ready)
                });
            assert!(
                all.len() <= 3,
                "more than replicas + maxSurge members: {:?}",
                all.keys()
            );
            rolled.then_some(all.len())
        }
    })
    .await;
    assert_eq!(most, 2);
    let rolled = world.members("eu").await;
    assert!(
        rolled.keys().all(|n| !two.contains_key(n)),
        "new members have new names"
    );
    assert!(
        rolled
            .values()
            .all(|p| p.annotations().get("rev").map(String::as_str) == Some("2"))
    );

    // Deleting the pool deletes its members and their Pods.
    world
        .pools()
        .delete("eu", &DeleteParams::default())
        .await
        .expect("delete the pool");
    support::world::wait_gone(&world.pools(), "eu").await;
    assert!(world.members("eu").await.is_empty());
    eventually("every member Pod gone", || async {
        world
            .pods()
            .list(&ListParams::default())
            .await
            .ok()?
            .items
            .is_empty()
            .then_some(())
    })
    .await;
    drop(operator);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn autoscaling_grows_to_max_on_demand_and_shrinks_one_at_a_time() {
    let Some(world) = World::new("pool-auto").await else {
        return;
    };
    let operator = world.operator(&[]).await;
    world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                "auto",
                json!({
                    "template": world.pool_template("auto", 1),
                    "autoscaling": {"minReplicas": 1, "maxReplicas": 3, "targetUtilization": 1.0,
                                    "scaleDownAfter": "3s"},
                }),
            ),
        )
        .await
        .expect("create the pool");
    world.wait_pool_settled("auto", 1, SLOW).await;

    // One lease per member at target 1.0: four crawlers want more than maxReplicas gives.
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(lease_id(&acquire_waiting(&operator, "auto").await));
    }
    let (status, body) = operator
        .call(
            Method::POST,
            "/v1/leases",
            Some(json!({"selector": {"geo": "auto"}})),
        )
        .await;
    assert_eq!(status, StatusCode::CONFLICT, "at max, at capacity: {body}");
    eventually("ScalingLimited AtMax", || async {
        let pool = world.pools().get("auto").await.ok()?;
        let c = pool.status?.condition("ScalingLimited").cloned()?;
        (c.status == proxy_operator::resources::proxy::ConditionStatus::True && c.reason == "AtMax")
            .then_some(())
    })
    .await;
    assert_eq!(world.pools().get("auto").await.unwrap().spec.replicas, 3);
    assert!(
        !world
            .events_with_reason("auto", "ScaledUp")
            .await
            .is_empty()
    );

    // Released, it shrinks to minReplicas one member at a time.
    for id in &held {
        operator.release(id).await;
    }
    let seen = std::sync::Mutex::new(Vec::new());
    within(
        Duration::from_secs(120),
        "the pool back at minReplicas",
        || async {
            let replicas = world.pools().get("auto").await.ok()?.spec.replicas;
            let mut seen = seen.lock().unwrap();
            if seen.last() != Some(&replicas) {
                seen.push(replicas);
            }
            (replicas == 1).then_some(())
        },
    )
    .await;
    let seen = seen.into_inner().unwrap();
    assert_eq!(seen, [3, 2, 1], "one member at a time");
    world.wait_pool_settled("auto", 1, SLOW).await;
    assert!(
        !world
            .events_with_reason("auto", "ScaledDown")
            .await
            .is_empty()
    );
    let metrics = operator.metrics().await;
    let scale_events = |direction: &str| {
        metric_sum(
            &metrics,
            "proxy_operator_pool_scale_events_total",
            &[&format!("direction=\"{direction}\"")],
        )
    };
    assert!(scale_events("up") >= 1.0, "{metrics}");
    assert_eq!(scale_events("down"), 2.0, "one member at a time: {metrics}");
    assert_eq!(
        metric_sum(&metrics, "proxy_operator_pool_replicas", &[]),
        1.0
    );
}

/// Acquires a lease on the pool labelled `geo: <geo>`, waiting through `409 no_match` and
/// `503 pool_waking` while it grows.
async fn acquire_waiting(operator: &OperatorProcess, geo: &str) -> Value {
    within(support::world::SLOW, "a lease on the pool", || async {
        let (status, body) = operator
            .call(
                Method::POST,
                "/v1/leases",
                Some(json!({"selector": {"geo": geo}, "ttlSeconds": 600})),
            )
            .await;
        match status {
            StatusCode::CREATED => Some(body),
            StatusCode::CONFLICT | StatusCode::SERVICE_UNAVAILABLE => {
                tokio::time::sleep(Duration::from_millis(200)).await;
                None
            }
            other => panic!("acquire answered {other}: {body}"),
        }
    })
    .await
}

/// A new price on the template is written onto the members as they are: the same objects
/// (UIDs), the same machines (IPs), no roll-out; removing it removes theirs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_price_on_the_template_is_patched_onto_the_members_without_a_roll_out() {
    let Some(world) = World::new("pool-price").await else {
        return;
    };
    let _operator = world.operator(&[]).await;
    world
        .raw_pools()
        .create(
            &PostParams::default(),
            &pool_object(
                "priced",
                json!({"replicas": 2, "template": world.pool_template("priced", 5)}),
            ),
        )
        .await
        .expect("create the pool");
    let before = world.wait_pool_settled("priced", 2, SLOW).await;
    let machines = |members: &BTreeMap<String, proxy_operator::resources::proxy::Proxy>| {
        members
            .iter()
            .map(|(name, p)| {
                let ip = p.status.as_ref().and_then(|s| s.ip.clone());
                (name.clone(), (p.uid(), ip))
            })
            .collect::<BTreeMap<_, _>>()
    };
    for (price, expected) in [
        (json!({"perGB": "8.40", "perHour": "0.01"}), Some("8.4")),
        (Value::Null, None),
    ] {
        world
            .pools()
            .patch(
                "priced",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"template": {"spec": {"cost": price}}}})),
            )
            .await
            .expect("price the template");
        let priced = eventually(&format!("every member priced {expected:?}"), || async {
            let members = world.members("priced").await;
            let per_gb = |p: &proxy_operator::resources::proxy::Proxy| {
                p.spec
                    .cost
                    .as_ref()
                    .and_then(|c| c.per_gb)
                    .map(|p| p.to_string())
            };
            (members.len() == 2 && members.values().all(|p| per_gb(p).as_deref() == expected))
                .then_some(members)
        })
        .await;
        assert_eq!(
            machines(&priced),
            machines(&before),
            "no member was replaced"
        );
        world.wait_pool_settled("priced", 2, SLOW).await;
    }
}
