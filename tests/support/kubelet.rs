//! A test kubelet: plays the nodes for the operator's squid Pods on the envtest control plane,
//! which has no scheduler and no kubelet (see `../shared/envtest/README.md`).
//!
//! It watches Pods labelled `crawl.example.com/managed=true`, binds each new one to a fake node,
//! runs the Pod's own squid configuration (container env `SQUID_CONFIG`) with a real squid on a
//! loopback address of its own (`127.X.Y.Z`; Linux routes all of 127/8 to `lo`), and reports it
//! through `pods/status` the way a kubelet does. A bound Pod's deletion is graceful: the kubelet
//! stops its squid and confirms with a grace-0 delete, unless the test made its node lost.
//! Per-Pod [`Behaviour`]s play the failures a real cluster shows; [`Kubelet::lose_node_of`] loses
//! the node of one Pod (one UID) only, so its same-named replacement runs normally.
//!
//! Run one kubelet per namespace (`Kubelet::start(client, Some(ns))`): two kubelets watching the
//! same Pods would both run them. Everything it started stops on drop; squid runs as user
//! `proxy` with a parent-death signal, so it also dies when the test process is killed.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Pod, Secret};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use proxy_operator::provider::squid_conf::{POD_RUN_DIR, SQUID_CONFIG_ENV, SQUID_PASSWD_ENV};
use proxy_operator::resources::proxy::MANAGED_LABEL;
use serde_json::{Value, json};
use tempfile::TempDir;

/// How often every known Pod is reconciled besides watch events (behaviour changes, crash-loop
/// restarts, retries of failed calls).
const TICK: Duration = Duration::from_millis(200);
/// How often a crash-looping container "restarts" (its restartCount rises).
const CRASH_PERIOD: Duration = Duration::from_secs(1);
/// Annotation naming the Proxy a managed Pod serves (set by the kubernetes provider).
const PROXY_ANNOTATION: &str = "crawl.example.com/proxy";
/// Name of the squid container in the operator's Pods.
const CONTAINER: &str = "squid";

/// What the node of a Pod does. Set with [`Kubelet::set_behaviour`] (by Pod name),
/// [`Kubelet::set_proxy_behaviour`] (by the Proxy the Pod serves) or
/// [`Kubelet::set_default_behaviour`]; a change applies to the current Pod and future ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Behaviour {
    /// Bound, squid running, `Running` with a podIP, Ready; deletions confirmed.
    #[default]
    Healthy,
    /// The node is gone: its squid is killed, status is no longer updated and deletions are
    /// never confirmed (the Pod stays Terminating until someone deletes it with grace 0). A Pod
    /// created under this behaviour is bound but never started. Set by name it also loses the
    /// replacement Pod (same name); [`Kubelet::lose_node_of`] loses one Pod only.
    LostNode,
    /// `Running` with a podIP, container waiting in `CrashLoopBackOff`, restartCount rising
    /// every second, Ready=False, no squid.
    CrashLoop,
    /// Bound, `Pending` with a podIP (the sandbox exists), container waiting in `ErrImagePull`,
    /// no squid.
    ImagePullError,
    /// Never bound: `Pending`, `PodScheduled=False` reason `Unschedulable`. Only Pods not yet
    /// bound are affected; a bound Pod keeps running as it was.
    Unschedulable,
}

/// A running test kubelet. Stops every squid it started, and its task, on drop.
pub struct Kubelet {
    state: Arc<Mutex<State>>,
    task: tokio::task::JoinHandle<()>,
    node: String,
}

impl Kubelet {
    /// Starts playing the nodes for managed Pods in `namespace` (or all namespaces), with
    /// `client` (the admin's: binding and `pods/status` are not the operator's rights).
    /// Must be called inside a tokio runtime.
    pub fn start(client: kube::Client, namespace: Option<&str>) -> Kubelet {
        static NODES: AtomicU32 = AtomicU32::new(0);
        let node = format!("envtest-node-{}", NODES.fetch_add(1, Ordering::Relaxed));
        let state = Arc::new(Mutex::new(State::default()));
        let worker = Worker {
            pods: match namespace {
                Some(namespace) => Api::namespaced(client.clone(), namespace),
                None => Api::all(client.clone()),
            },
            client,
            state: state.clone(),
            node: node.clone(),
        };
        let task = tokio::spawn(worker.run());
        Kubelet { state, task, node }
    }

    /// The (fake) node Pods are bound to.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// Sets the behaviour of the Pod `namespace/pod` (current and future Pods of that name).
    pub fn set_behaviour(&self, namespace: &str, pod: &str, behaviour: Behaviour) {
        self.lock()
            .by_pod
            .insert((namespace.to_owned(), pod.to_owned()), behaviour);
    }

    /// Sets the behaviour of the Pods serving the Proxy `namespace/proxy` (annotation
    /// `crawl.example.com/proxy`), usable before the Proxy exists. A Pod-name behaviour wins.
    pub fn set_proxy_behaviour(&self, namespace: &str, proxy: &str, behaviour: Behaviour) {
        self.lock()
            .by_proxy
            .insert((namespace.to_owned(), proxy.to_owned()), behaviour);
    }

    /// Sets the behaviour of every Pod with no behaviour of its own.
    pub fn set_default_behaviour(&self, behaviour: Behaviour) {
        self.lock().default = behaviour;
    }

    /// Loses the node of the current Pod `namespace/pod` only: the newest Pod of that name the
    /// kubelet knows, pinned by its UID. Its squid is killed before this returns, its status is
    /// no longer updated, and its deletion is never confirmed, so once deleted it stays
    /// Terminating until someone deletes it with grace 0 (the operator's force-delete). A new
    /// Pod of the same name (the replacement, a new UID) runs with the name's behaviour as
    /// usual. That is the point: the operator reuses the machine name, so
    /// `set_behaviour(.., LostNode)` would lose the replacement's node too.
    ///
    /// Returns the UID of the Pod whose node was lost, or `None` (and changes nothing) when the
    /// kubelet knows no Pod of that name now.
    pub fn lose_node_of(&self, namespace: &str, pod: &str) -> Option<String> {
        let key = (namespace.to_owned(), pod.to_owned());
        let (uid, squid) = {
            let mut state = self.lock();
            let uid = state
                .seen
                .get(&key)?
                .iter()
                .rev()
                .find(|uid| state.records.contains_key(*uid))?
                .clone();
            state.lost.insert(uid.clone());
            let squid = state.records.get_mut(&uid).and_then(|r| r.squid.take());
            (uid, squid)
        };
        // Killed and reaped by its drop, outside the lock.
        drop(squid);
        Some(uid)
    }

    /// The podIP last published for a Pod of this name (kept after the Pod is gone, replaced
    /// when a new Pod of the name gets one).
    pub fn address(&self, namespace: &str, pod: &str) -> Option<IpAddr> {
        self.lock()
            .addresses
            .get(&(namespace.to_owned(), pod.to_owned()))
            .copied()
    }

    /// How many squids run now.
    pub fn squid_count(&self) -> usize {
        self.lock()
            .records
            .values()
            .filter(|r| r.squid.is_some())
            .count()
    }

    /// Whether a squid runs now for the Pod `namespace/pod`.
    pub fn squid_running(&self, namespace: &str, pod: &str) -> bool {
        let key = (namespace.to_owned(), pod.to_owned());
        self.lock()
            .records
            .values()
            .any(|r| r.key == key && r.squid.is_some())
    }

    /// UIDs of the Pods of this name whose squid was started, oldest first (a UID appears once
    /// even if its squid restarted).
    pub fn started(&self, namespace: &str, pod: &str) -> Vec<String> {
        self.lock()
            .started
            .get(&(namespace.to_owned(), pod.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// UIDs of the Pods of this name the kubelet has seen, oldest first.
    pub fn seen(&self, namespace: &str, pod: &str) -> Vec<String> {
        self.lock()
            .seen
            .get(&(namespace.to_owned(), pod.to_owned()))
            .cloned()
            .unwrap_or_default()
    }

    /// Freezes (SIGSTOP) the squid of the current Pod `namespace/pod` (the newest Pod of that
    /// name whose squid runs): the process stays alive and its port keeps accepting TCP
    /// connections into the listen backlog, but nothing answers, so every probe through it times
    /// out. The Pod's status is untouched (still `Running`, Ready): a wedged proxy only health
    /// checks can see. A replacement Pod (a new UID) runs a squid of its own, not frozen; a
    /// frozen squid is still killed as usual when its Pod goes. Returns the UID of the Pod whose
    /// squid was frozen, or `None` when no squid runs for that name now.
    pub fn freeze_squid_of(&self, namespace: &str, pod: &str) -> Option<String> {
        self.signal_squid_of(namespace, pod, libc::SIGSTOP)
    }

    /// Resumes (SIGCONT) a squid frozen by [`Kubelet::freeze_squid_of`]; returns the Pod UID.
    pub fn thaw_squid_of(&self, namespace: &str, pod: &str) -> Option<String> {
        self.signal_squid_of(namespace, pod, libc::SIGCONT)
    }

    /// Sends `signal` to the squid of the newest Pod of this name whose squid runs.
    fn signal_squid_of(&self, namespace: &str, pod: &str, signal: libc::c_int) -> Option<String> {
        let key = (namespace.to_owned(), pod.to_owned());
        let state = self.lock();
        let (uid, pid) = state.seen.get(&key)?.iter().rev().find_map(|uid| {
            let squid = state.records.get(uid)?.squid.as_ref()?;
            Some((uid.clone(), squid.child.id()))
        })?;
        let pid = i32::try_from(pid).ok()?;
        // SAFETY: kill(2) on a child this kubelet spawned and has not reaped (its record holds
        // it, under the lock).
        let sent = unsafe { libc::kill(pid, signal) } == 0;
        sent.then_some(uid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Kubelet {
    fn drop(&mut self) {
        self.task.abort();
        let squids: Vec<RunningSquid> = {
            let mut state = self.lock();
            state.stopped = true;
            state
                .records
                .values_mut()
                .filter_map(|r| r.squid.take())
                .collect()
        };
        // Each one is killed and reaped by its own drop.
        drop(squids);
    }
}

type Key = (String, String);

#[derive(Default)]
struct State {
    by_pod: HashMap<Key, Behaviour>,
    by_proxy: HashMap<Key, Behaviour>,
    default: Behaviour,
    /// Pods the kubelet knows, by UID.
    records: HashMap<String, Record>,
    started: HashMap<Key, Vec<String>>,
    seen: HashMap<Key, Vec<String>>,
    addresses: HashMap<Key, IpAddr>,
    /// UIDs whose node [`Kubelet::lose_node_of`] lost: [`Behaviour::LostNode`] for that Pod
    /// whatever its name's behaviour. By UID, not name, so the replacement is not lost too.
    lost: HashSet<String>,
    /// Set on drop: a squid that finishes starting afterwards is killed at once.
    stopped: bool,
}

impl State {
    fn behaviour(&self, uid: &str, key: &Key, proxy: Option<&str>) -> Behaviour {
        if self.lost.contains(uid) {
            return Behaviour::LostNode;
        }
        self.by_pod
            .get(key)
            .or_else(|| proxy.and_then(|p| self.by_proxy.get(&(key.0.clone(), p.to_owned()))))
            .copied()
            .unwrap_or(self.default)
    }
}

/// What the kubelet knows about one Pod (one UID).
struct Record {
    key: Key,
    bound: bool,
    address: Option<Ipv4Addr>,
    address_published: bool,
    squid: Option<RunningSquid>,
    published: Option<Published>,
    restarts: i32,
    last_crash: Option<Instant>,
    /// When starting squid last failed (retried after [`CRASH_PERIOD`]).
    last_start_failure: Option<Instant>,
    deletion_confirmed: bool,
    /// The last problem logged, so each is logged once.
    complaint: Option<String>,
}

/// The status last written for a Pod.
#[derive(Debug, Clone, PartialEq)]
enum Published {
    Unschedulable,
    ImagePull(Ipv4Addr),
    CrashLoop(Ipv4Addr, i32),
    Running(Ipv4Addr, i32),
}

struct Worker {
    pods: Api<Pod>,
    /// Reads the Secrets a Pod's env names (`valueFrom.secretKeyRef`), as a kubelet does.
    client: kube::Client,
    state: Arc<Mutex<State>>,
    node: String,
}

impl Worker {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn run(self) {
        let config = watcher::Config::default().labels(&format!("{MANAGED_LABEL}=true"));
        let mut events = watcher::watcher(self.pods.clone(), config)
            .default_backoff()
            .boxed();
        let mut pods: BTreeMap<Key, Pod> = BTreeMap::new();
        let mut relist: Option<BTreeMap<Key, Pod>> = None;
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ended = false;
        loop {
            tokio::select! {
                event = events.next(), if !ended => match event {
                    Some(Ok(Event::Init)) => relist = Some(BTreeMap::new()),
                    Some(Ok(Event::InitApply(pod))) => {
                        relist.get_or_insert_with(BTreeMap::new).insert(key_of(&pod), pod);
                    }
                    Some(Ok(Event::InitDone)) => pods = relist.take().unwrap_or_default(),
                    Some(Ok(Event::Apply(pod))) => {
                        pods.insert(key_of(&pod), pod);
                    }
                    Some(Ok(Event::Delete(pod))) => {
                        pods.remove(&key_of(&pod));
                    }
                    Some(Err(e)) => eprintln!("kubelet {}: watch error (retrying): {e}", self.node),
                    None => {
                        eprintln!("kubelet {}: the Pod watch ended", self.node);
                        ended = true;
                    }
                },
                _ = tick.tick() => {}
            }
            self.reconcile_all(&pods).await;
        }
    }

    async fn reconcile_all(&self, pods: &BTreeMap<Key, Pod>) {
        // Forget Pods that are gone; dropping a record kills its squid.
        let gone: Vec<Record> = {
            let mut state = self.lock();
            let live: Vec<&str> = pods
                .values()
                .filter_map(|p| p.metadata.uid.as_deref())
                .collect();
            let gone: Vec<String> = state
                .records
                .keys()
                .filter(|uid| !live.contains(&uid.as_str()))
                .cloned()
                .collect();
            for uid in &gone {
                state.lost.remove(uid);
            }
            gone.iter()
                .filter_map(|uid| state.records.remove(uid))
                .collect()
        };
        drop(gone);
        for pod in pods.values() {
            self.reconcile(pod).await;
        }
    }

    async fn reconcile(&self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.clone() else {
            return;
        };
        let key = key_of(pod);
        let proxy = pod
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(PROXY_ANNOTATION))
            .map(String::as_str);
        let node_name = pod.spec.as_ref().and_then(|s| s.node_name.as_deref());
        let (behaviour, bound) = {
            let mut state = self.lock();
            if state.stopped {
                return;
            }
            let behaviour = state.behaviour(&uid, &key, proxy);
            if !state.records.contains_key(&uid) {
                state.seen.entry(key.clone()).or_default().push(uid.clone());
                state.records.insert(uid.clone(), Record::new(key.clone()));
            }
            let record = state.records.get_mut(&uid).expect("record just ensured");
            if let Some(node) = node_name {
                if node != self.node && !record.bound {
                    record.complain(&format!(
                        "pod {}/{} is bound to {node}, not {}; running it anyway",
                        key.0, key.1, self.node
                    ));
                }
                record.bound = true;
            }
            (behaviour, record.bound)
        };

        if pod.metadata.deletion_timestamp.is_some() {
            self.stop_squid(&uid);
            if behaviour != Behaviour::LostNode && bound {
                self.confirm_deletion(pod, &uid).await;
            }
            return;
        }
        if behaviour == Behaviour::Unschedulable {
            if !bound {
                self.publish(pod, &uid, Published::Unschedulable).await;
            }
            return;
        }
        if !bound && !self.bind(pod, &uid).await {
            return;
        }
        match behaviour {
            Behaviour::Unschedulable => {}
            Behaviour::LostNode => self.stop_squid(&uid),
            Behaviour::ImagePullError => {
                self.stop_squid(&uid);
                let address = self.address(&uid);
                self.publish(pod, &uid, Published::ImagePull(address)).await;
            }
            Behaviour::CrashLoop => {
                self.stop_squid(&uid);
                let address = self.address(&uid);
                let restarts = {
                    let mut state = self.lock();
                    let Some(record) = state.records.get_mut(&uid) else {
                        return;
                    };
                    let due = !matches!(record.published, Some(Published::CrashLoop(..)))
                        || record
                            .last_crash
                            .is_none_or(|t| t.elapsed() >= CRASH_PERIOD);
                    if due {
                        record.restarts += 1;
                        record.last_crash = Some(Instant::now());
                    }
                    record.restarts
                };
                self.publish(pod, &uid, Published::CrashLoop(address, restarts))
                    .await;
            }
            Behaviour::Healthy => {
                if let Some(address) = self.ensure_squid(pod, &uid).await {
                    let restarts = self.lock().records.get(&uid).map_or(0, |r| r.restarts);
                    self.publish(pod, &uid, Published::Running(address, restarts))
                        .await;
                }
            }
        }
    }

    /// `POST pods/P/binding` to this kubelet's node; true once the Pod is bound.
    async fn bind(&self, pod: &Pod, uid: &str) -> bool {
        let (namespace, name) = key_of(pod);
        let binding = json!({
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": name, "namespace": namespace, "uid": uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": self.node},
        });
        let result: Result<Value, _> = self
            .pods
            .create_subresource("binding", &name, &PostParams::default(), &binding)
            .await;
        let bound = match result {
            Ok(_) => true,
            // Already assigned (a watch event lagging behind our own bind).
            Err(kube::Error::Api(status)) if status.code == 409 => true,
            Err(kube::Error::Api(status)) if status.code == 404 => false,
            Err(e) => {
                self.complain(uid, &format!("bind {namespace}/{name}: {e}"));
                false
            }
        };
        if bound && let Some(record) = self.lock().records.get_mut(uid) {
            record.bound = true;
        }
        bound
    }

    /// Confirms a graceful deletion with a grace-0 delete of exactly this UID (a new Pod of the
    /// same name is never deleted by mistake).
    async fn confirm_deletion(&self, pod: &Pod, uid: &str) {
        let confirmed = {
            let state = self.lock();
            // A node lost while this pass was under way confirms nothing.
            state.lost.contains(uid) || state.records.get(uid).is_none_or(|r| r.deletion_confirmed)
        };
        if confirmed {
            return;
        }
        let (namespace, name) = key_of(pod);
        let params = DeleteParams {
            grace_period_seconds: Some(0),
            preconditions: Some(Preconditions {
                uid: Some(uid.to_owned()),
                resource_version: None,
            }),
            ..DeleteParams::default()
        };
        let done = match self.pods.delete(&name, &params).await {
            Ok(_) => true,
            Err(kube::Error::Api(status)) if status.code == 404 || status.code == 409 => true,
            Err(e) => {
                self.complain(uid, &format!("confirm deletion of {namespace}/{name}: {e}"));
                false
            }
        };
        if done && let Some(record) = self.lock().records.get_mut(uid) {
            record.deletion_confirmed = true;
        }
    }

    /// Writes `desired` to `pods/status` unless it is what was last written.
    async fn publish(&self, pod: &Pod, uid: &str, desired: Published) {
        let already = {
            let state = self.lock();
            // A lost node reports nothing more, even from a pass that began before it was lost.
            state.lost.contains(uid)
                || state
                    .records
                    .get(uid)
                    .is_none_or(|r| r.published.as_ref() == Some(&desired))
        };
        if already {
            return;
        }
        let (namespace, name) = key_of(pod);
        let ip = match desired {
            Published::Unschedulable => None,
            Published::ImagePull(ip) | Published::CrashLoop(ip, _) | Published::Running(ip, _) => {
                Some(ip)
            }
        };
        // Recorded before the patch: a test that sees the new podIP on the server must find
        // the same address here.
        if let Some(ip) = ip {
            let mut state = self.lock();
            state
                .addresses
                .insert((namespace.clone(), name.clone()), IpAddr::V4(ip));
            if let Some(record) = state.records.get_mut(uid) {
                record.address_published = true;
            }
        }
        let patch = status_patch(pod, &desired);
        let result = self
            .pods
            .patch_status(&name, &PatchParams::default(), &Patch::Merge(&patch))
            .await;
        match result {
            Ok(_) => {
                if let Some(record) = self.lock().records.get_mut(uid) {
                    record.published = Some(desired);
                }
            }
            Err(kube::Error::Api(status)) if status.code == 404 => {}
            Err(e) => self.complain(uid, &format!("patch status of {namespace}/{name}: {e}")),
        }
    }

    /// This Pod's address, allocated on first use.
    fn address(&self, uid: &str) -> Ipv4Addr {
        let mut state = self.lock();
        match state.records.get_mut(uid) {
            Some(record) => *record.address.get_or_insert_with(next_address),
            None => next_address(),
        }
    }

    fn stop_squid(&self, uid: &str) {
        let squid = self
            .lock()
            .records
            .get_mut(uid)
            .and_then(|r| r.squid.take());
        drop(squid);
    }

    /// Makes sure a squid runs for the Pod; returns its address when it does.
    async fn ensure_squid(&self, pod: &Pod, uid: &str) -> Option<Ipv4Addr> {
        {
            let mut state = self.lock();
            let record = state.records.get_mut(uid)?;
            if let Some(squid) = record.squid.as_mut() {
                match squid.child.try_wait() {
                    Ok(None) => return record.address,
                    status => {
                        let log = squid.log();
                        let (namespace, name) = record.key.clone();
                        eprintln!(
                            "kubelet: squid of {namespace}/{name} exited ({status:?}); \
                             restarting it\n{log}"
                        );
                        record.squid = None;
                        record.restarts += 1;
                    }
                }
            }
            if record
                .last_start_failure
                .is_some_and(|t| t.elapsed() < CRASH_PERIOD)
            {
                return None;
            }
        }
        let (namespace, name) = key_of(pod);
        let config = match squid_config_of(pod) {
            Ok(config) => config,
            Err(problem) => {
                self.complain(uid, &format!("cannot run {namespace}/{name}: {problem}"));
                return None;
            }
        };
        let passwd = match self.squid_passwd_of(pod, &namespace).await {
            Ok(passwd) => passwd,
            Err(problem) => {
                // A kubelet cannot start the container either (CreateContainerConfigError).
                self.complain(uid, &format!("cannot run {namespace}/{name}: {problem}"));
                return None;
            }
        };
        // A leaked squid of an earlier run may hold an address: try new ones until one is
        // published (then the Pod's IP must stay).
        for _ in 0..5 {
            let (address, published) = {
                let mut state = self.lock();
                let record = state.records.get_mut(uid)?;
                let address = *record.address.get_or_insert_with(next_address);
                (address, record.address_published)
            };
            let config = config.clone();
            let passwd = passwd.clone();
            let started = tokio::task::spawn_blocking(move || {
                RunningSquid::start(&config, passwd.as_deref(), address)
            })
            .await
            .unwrap_or_else(|e| Err(format!("the squid start-up task failed: {e}")));
            let mut state = self.lock();
            match started {
                Ok(squid) => {
                    // Dropping `squid` here kills it: the kubelet stopped, or the node was lost
                    // while it started.
                    if state.stopped || state.lost.contains(uid) {
                        return None;
                    }
                    let record = state.records.get_mut(uid)?;
                    record.squid = Some(squid);
                    record.last_start_failure = None;
                    let started = state.started.entry(key_of(pod)).or_default();
                    if !started.iter().any(|u| u == uid) {
                        started.push(uid.to_owned());
                    }
                    return Some(address);
                }
                Err(problem) => {
                    let record = state.records.get_mut(uid)?;
                    record.complain(&format!(
                        "squid for {namespace}/{name} on {address} did not start: {problem}"
                    ));
                    record.last_start_failure = Some(Instant::now());
                    if published {
                        return None;
                    }
                    record.address = Some(next_address());
                }
            }
        }
        None
    }

    /// The password-file line the Pod's squid container gets in `SQUID_PASSWD`, read from the
    /// Secret its env names, as a kubelet resolves `valueFrom.secretKeyRef`; `None` when the
    /// container has no such env (an open squid).
    async fn squid_passwd_of(&self, pod: &Pod, namespace: &str) -> Result<Option<String>, String> {
        let Some(reference) = squid_container(pod)
            .ok()
            .and_then(|c| c.env.as_ref())
            .and_then(|env| env.iter().find(|e| e.name == SQUID_PASSWD_ENV))
            .and_then(|e| e.value_from.as_ref())
            .and_then(|v| v.secret_key_ref.clone())
        else {
            return Ok(None);
        };
        let secrets: Api<Secret> = Api::namespaced(self.client.clone(), namespace);
        let secret = secrets
            .get_opt(&reference.name)
            .await
            .map_err(|e| format!("read Secret {namespace}/{}: {e}", reference.name))?
            .ok_or_else(|| format!("Secret {namespace}/{} not found", reference.name))?;
        let value = secret
            .data
            .as_ref()
            .and_then(|d| d.get(&reference.key))
            .ok_or_else(|| {
                format!(
                    "Secret {namespace}/{} has no key {:?}",
                    reference.name, reference.key
                )
            })?;
        String::from_utf8(value.0.clone())
            .map(Some)
            .map_err(|_| format!("Secret {namespace}/{} is not UTF-8", reference.name))
    }

    fn complain(&self, uid: &str, problem: &str) {
        match self.lock().records.get_mut(uid) {
            Some(record) => record.complain(problem),
            None => eprintln!("kubelet: {problem}"),
        }
    }
}

impl Record {
    fn new(key: Key) -> Record {
        Record {
            key,
            bound: false,
            address: None,
            address_published: false,
            squid: None,
            published: None,
            restarts: 0,
            last_crash: None,
            last_start_failure: None,
            deletion_confirmed: false,
            complaint: None,
        }
    }

    /// Logs `problem` unless it is the one logged last for this Pod.
    fn complain(&mut self, problem: &str) {
        if self.complaint.as_deref() != Some(problem) {
            eprintln!("kubelet: {problem}");
            self.complaint = Some(problem.to_owned());
        }
    }
}

fn key_of(pod: &Pod) -> Key {
    (
        pod.metadata.namespace.clone().unwrap_or_default(),
        pod.metadata.name.clone().unwrap_or_default(),
    )
}

/// A new loopback address: `127.<10 + pid % 240>.<n / 250>.<1 + n % 250>`. The second octet
/// keeps clear of `127.0.0.1`/`127.0.1.1` and mostly apart from other test processes; a clash
/// (or a squid leaked by a killed run) only makes squid fail to bind, and the next address is
/// tried.
pub fn next_address() -> Ipv4Addr {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed) % (250 * 250);
    let process = (10 + std::process::id() % 240) as u8;
    Ipv4Addr::new(127, process, (n / 250) as u8, (1 + n % 250) as u8)
}

/// The Pod's squid container.
fn squid_container(pod: &Pod) -> Result<&Container, String> {
    let containers = pod
        .spec
        .as_ref()
        .map(|s| s.containers.as_slice())
        .unwrap_or_default();
    containers
        .iter()
        .find(|c| c.name == CONTAINER)
        .or(containers.first())
        .ok_or_else(|| "the Pod has no container".to_owned())
}

/// The squid configuration the Pod carries in its squid container's `SQUID_CONFIG` env.
fn squid_config_of(pod: &Pod) -> Result<String, String> {
    let container = squid_container(pod)?;
    let env = container
        .env
        .as_ref()
        .and_then(|env| env.iter().find(|e| e.name == SQUID_CONFIG_ENV))
        .ok_or_else(|| format!("container {} has no env {SQUID_CONFIG_ENV}", container.name))?;
    env.value.clone().filter(|v| !v.is_empty()).ok_or_else(|| {
        format!(
            "env {SQUID_CONFIG_ENV} of container {} has no literal value",
            container.name
        )
    })
}

/// The Pod's configuration made runnable here: `http_port` bound to `address`, the run dir
/// (and so the access-log FIFO path) moved into `dir` as plain files, its own cache log, no pid
/// file. Returns the text and the (first) port.
pub fn rewrite_squid_config(
    config: &str,
    address: Ipv4Addr,
    dir: &Path,
) -> Result<(String, u16), String> {
    let dir_text = dir.display().to_string();
    let mut out = String::new();
    let mut port = None;
    let mut hostname = false;
    for line in config.lines() {
        let mut words = line.split_whitespace();
        match words.next() {
            Some("http_port") => {
                let spec = words
                    .next()
                    .ok_or_else(|| format!("http_port without a port: {line:?}"))?;
                let number = spec.rsplit(':').next().unwrap_or(spec);
                let number: u16 = number
                    .parse()
                    .map_err(|_| format!("cannot read the port of {line:?}"))?;
                port.get_or_insert(number);
                let options: Vec<&str> = words.collect();
                out.push_str(&format!("http_port {address}:{number}"));
                for option in options {
                    out.push(' ');
                    out.push_str(option);
                }
                out.push('\n');
            }
            // Replaced below by paths of this kubelet's own.
            Some("pid_filename" | "cache_log" | "coredump_dir") => {}
            first => {
                hostname |= first == Some("visible_hostname");
                out.push_str(&line.replace(POD_RUN_DIR, &dir_text));
                out.push('\n');
            }
        }
    }
    let port = port.ok_or("the configuration has no http_port line")?;
    out.push_str(&format!(
        "pid_filename none\ncache_log {dir_text}/cache.log\n"
    ));
    if !hostname {
        out.push_str("visible_hostname envtest-kubelet\n");
    }
    Ok((out, port))
}

/// One Pod's squid. Killed and reaped on drop.
struct RunningSquid {
    child: Child,
    dir: TempDir,
    address: SocketAddr,
}

impl RunningSquid {
    /// Starts squid with the Pod's `config` (and its password file `passwd`, written where the
    /// container's launch script writes it) on `address` and waits until it accepts.
    fn start(
        config: &str,
        passwd: Option<&str>,
        address: Ipv4Addr,
    ) -> Result<RunningSquid, String> {
        let dir = tempfile::Builder::new()
            .prefix("envtest-kubelet-squid-")
            .tempdir()
            .map_err(|e| format!("create a temp dir: {e}"))?;
        // Started as root, squid drops to user `proxy`, which must write its logs here.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o777))
            .map_err(|e| format!("chmod the squid dir: {e}"))?;
        let (text, port) = rewrite_squid_config(config, address, dir.path())?;
        if let Some(line) = passwd {
            let file = dir.path().join("passwd");
            std::fs::write(&file, format!("{line}\n"))
                .map_err(|e| format!("write {}: {e}", file.display()))?;
        }
        let conf = dir.path().join("squid.conf");
        std::fs::write(&conf, text).map_err(|e| format!("write {}: {e}", conf.display()))?;
        let stderr = std::fs::File::create(dir.path().join("stderr.log"))
            .map_err(|e| format!("create the squid stderr log: {e}"))?;
        let binary = squid_binary()?;
        let mut command = Command::new(&binary);
        command
            .arg("-N")
            .arg("-d")
            .arg("1")
            .arg("-f")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // Started as `proxy` directly (not as root dropping to it, which clears the parent-death
        // signal), squid dies with the test process even when that is killed. Ports below 1024
        // need root.
        if port >= 1024
            && let Some((uid, gid)) = unprivileged_user()
        {
            command.uid(uid).gid(gid);
        }
        let child = super::envtest::spawn_tied(command)
            .map_err(|e| format!("spawn {}: {e}", binary.display()))?;
        let mut squid = RunningSquid {
            child,
            dir,
            address: SocketAddr::from((address, port)),
        };
        let deadline = Instant::now() + super::DEADLINE;
        loop {
            if TcpStream::connect_timeout(&squid.address, Duration::from_millis(200)).is_ok() {
                return Ok(squid);
            }
            if let Ok(Some(status)) = squid.child.try_wait() {
                return Err(format!("squid exited ({status}):\n{}", squid.log()));
            }
            if Instant::now() > deadline {
                return Err(format!(
                    "squid did not listen on {} within {:?}:\n{}",
                    squid.address,
                    super::DEADLINE,
                    squid.log()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// squid's stderr and cache log.
    fn log(&self) -> String {
        let read =
            |file: &str| std::fs::read_to_string(self.dir.path().join(file)).unwrap_or_default();
        format!("{}{}", read("stderr.log"), read("cache.log"))
    }
}

impl Drop for RunningSquid {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The uid and gid of user `proxy` (squid's own) when this process runs as root.
fn unprivileged_user() -> Option<(u32, u32)> {
    static USER: std::sync::OnceLock<Option<(u32, u32)>> = std::sync::OnceLock::new();
    *USER.get_or_init(|| {
        // SAFETY: getpwnam's result is read at once, before any other passwd lookup here.
        unsafe {
            if libc::geteuid() != 0 {
                return None;
            }
            let entry = libc::getpwnam(c"proxy".as_ptr());
            if entry.is_null() {
                return None;
            }
            Some(((*entry).pw_uid, (*entry).pw_gid))
        }
    })
}

fn squid_binary() -> Result<PathBuf, String> {
    std::env::var_os("PATH")
        .map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/usr/local/sbin")])
        .map(|dir| dir.join("squid"))
        .find(|candidate| candidate.is_file())
        .ok_or_else(|| "squid is not installed (apt-get install -y squid)".to_owned())
}

/// The `pods/status` merge patch for `published` (lists are replaced whole).
fn status_patch(pod: &Pod, published: &Published) -> Value {
    let now = jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string();
    let container = pod.spec.as_ref().and_then(|s| {
        s.containers
            .iter()
            .find(|c| c.name == CONTAINER)
            .or(s.containers.first())
    });
    let container_name = container.map_or(CONTAINER, |c| c.name.as_str());
    let image = container.and_then(|c| c.image.clone()).unwrap_or_default();
    let condition = |kind: &str, ok: bool| {
        let mut c = json!({"type": kind, "status": if ok { "True" } else { "False" }, "lastTransitionTime": now});
        if !ok {
            c["reason"] = json!("ContainersNotReady");
            c["message"] = json!(format!(
                "containers with unready status: [{container_name}]"
            ));
        }
        c
    };
    let conditions = |ready: bool| {
        json!([
            condition("PodScheduled", true),
            condition("Initialized", true),
            condition("ContainersReady", ready),
            condition("Ready", ready),
        ])
    };
    let container_status = |ready: bool, restarts: i32, state: Value, last: Value| {
        json!([{
            "name": container_name,
            "image": image,
            "imageID": "",
            "ready": ready,
            "started": ready,
            "restartCount": restarts,
            "state": state,
            "lastState": last,
        }])
    };
    let addresses = |ip: &Ipv4Addr| {
        json!({
            "podIP": ip.to_string(),
            "podIPs": [{"ip": ip.to_string()}],
            "hostIP": "127.0.0.1",
            "startTime": now,
        })
    };
    let mut status = match published {
        Published::Unschedulable => json!({
            "phase": "Pending",
            "conditions": [{
                "type": "PodScheduled",
                "status": "False",
                "reason": "Unschedulable",
                "message": "0/1 nodes are available: 1 Insufficient cpu. \
                            (test kubelet behaviour Unschedulable)",
                "lastTransitionTime": now,
            }],
        }),
        Published::ImagePull(ip) => {
            let mut status = addresses(ip);
            status["phase"] = json!("Pending");
            status["conditions"] = conditions(false);
            status["containerStatuses"] = container_status(
                false,
                0,
                json!({"waiting": {
                    "reason": "ErrImagePull",
                    "message": format!("failed to pull image {image:?}: pull access denied \
                                        (test kubelet behaviour ImagePullError)"),
                }}),
                json!({}),
            );
            status
        }
        Published::CrashLoop(ip, restarts) => {
            let mut status = addresses(ip);
            status["phase"] = json!("Running");
            status["conditions"] = conditions(false);
            status["containerStatuses"] = container_status(
                false,
                *restarts,
                json!({"waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": format!("back-off 10s restarting failed container={container_name} \
                                        (test kubelet behaviour CrashLoop)"),
                }}),
                json!({"terminated": {
                    "exitCode": 1,
                    "reason": "Error",
                    "startedAt": now,
                    "finishedAt": now,
                }}),
            );
            status
        }
        Published::Running(ip, restarts) => {
            let mut status = addresses(ip);
            status["phase"] = json!("Running");
            status["conditions"] = conditions(true);
            status["containerStatuses"] = container_status(
                true,
                *restarts,
                json!({"running": {"startedAt": now}}),
                json!({}),
            );
            status
        }
    };
    if let Some(object) = status.as_object_mut() {
        object.retain(|_, v| !v.is_null());
    }
    json!({ "status": status })
}
