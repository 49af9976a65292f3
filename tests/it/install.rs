//! The install as shipped, run by the test kubelet: being written.
