//! The control plane: the controllers, side by side, each the only writer of its resource's
//! status. `proxy` reconciles each Proxy with its machine, `pool` each ProxyPool with its
//! members, `gc` deletes the machines no Proxy owns; `budget` is the fleet-wide replacement
//! budget the two controllers share. They run on the leader only, and read the fleet from the
//! layers below them; the crawler-facing servers never import them.

pub mod budget;
pub mod gc;
pub mod pool;
pub mod proxy;
