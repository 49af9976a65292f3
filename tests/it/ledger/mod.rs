//! The lease ledger against real SQLite files.

mod bound;
mod crash;
mod end_leases;
mod leases;
mod writer;
