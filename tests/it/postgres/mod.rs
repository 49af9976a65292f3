//! Everything PostgreSQL: the test servers themselves, what only the PostgreSQL ledger
//! promises, TLS to the database, the install overlay, and several replicas on one database
//! under load and `kill -9`.

mod ledger;
mod overlay;
mod replicas;
mod support;
mod tls;
