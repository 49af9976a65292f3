//! The test kubelet for the operator's own Pod: being written.
