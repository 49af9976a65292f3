//! A pooled connection whose statements are sent together where they do not wait for each
//! other's answers, BEGIN with the first and COMMIT with the last: a transaction of n such
//! steps costs n round trips, where `Transaction` costs n + 2. tokio-postgres sends the
//! requests of one connection in the order they are first polled and answers them in that
//! order, so the futures joined in one `try_join!` go out back to back, and the server runs
//! them in that order.
//!
//! A statement is sent at its first poll only when it is prepared already: a step prepares its
//! statements first (from the connection's cache; a round trip only the first time a
//! connection sees them), so that its order is the order it names them in, never a cache
//! miss's.
//!
//! Used by the batch tasks, which run every transaction to its end: one that fails is rolled
//! back (or its connection closed) by [`Pipelined::finish`] before the connection is pooled
//! again. Without a BEGIN every statement commits by itself, and a caller giving up
//! mid-way leaves nothing open.

use std::sync::atomic::{AtomicBool, Ordering};

use super::store::StoreError;
use deadpool_postgres::{Client, GenericClient};

pub(crate) struct Pipelined<'a> {
    client: &'a Client,
    /// A BEGIN was sent and no COMMIT has been answered.
    open: AtomicBool,
}

impl<'a> Pipelined<'a> {
    pub fn new(client: &'a Client) -> Self {
        Pipelined {
            client,
            open: AtomicBool::new(false),
        }
    }

    /// The connection, for statements.
    pub fn client(&self) -> &'a Client {
        self.client
    }

    /// Puts `sqls` in the connection's statement cache, so that the step that runs them sends
    /// them in the order it polls them.
    pub async fn prepare(&self, sqls: &[&str]) -> Result<(), StoreError> {
        futures::future::try_join_all(sqls.iter().map(|sql| self.client.prepare_cached(sql)))
            .await?;
        Ok(())
    }

    /// Opens the transaction: joined with the first step's statements, ahead of them.
    pub async fn begin(&self) -> Result<(), StoreError> {
        self.open.store(true, Ordering::Relaxed);
        Ok(self.client.batch_execute("BEGIN").await?)
    }

    /// Commits: joined with the last step's statements, after them. If one of them fails,
    /// the server ends the transaction at this COMMIT without committing anything.
    pub async fn commit(&self) -> Result<(), StoreError> {
        self.client.batch_execute("COMMIT").await?;
        self.open.store(false, Ordering::Relaxed);
        Ok(())
    }

    /// What to do with the connection after `outcome`: nothing to undo when it succeeded
    /// (committed, or never opened); otherwise a transaction still open is rolled back.
    /// Returns whether the connection may be pooled again.
    pub async fn finish<T>(self, outcome: &Result<T, StoreError>) -> bool {
        if outcome.as_ref().is_err_and(StoreError::breaks_connection) {
            return false;
        }
        if !self.open.load(Ordering::Relaxed) {
            return true;
        }
        // A failed step, or a COMMIT whose answer did not come: a ROLLBACK after a COMMIT that
        // did end it is only a warning.
        self.client.batch_execute("ROLLBACK").await.is_ok()
    }
}
