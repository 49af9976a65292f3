//! The lease ledger against real SQLite files and a real PostgreSQL server.

mod bound;
mod crash;
mod demand;
mod durability;
mod end_leases;
mod leases;
mod tenants;
mod traffic;
mod writer;
