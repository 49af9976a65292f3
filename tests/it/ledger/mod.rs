//! The lease ledger against real SQLite files and a real PostgreSQL server.

mod bound;
mod crash;
mod end_leases;
mod leases;
mod postgres;
mod writer;
