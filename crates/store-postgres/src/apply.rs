//! The transactional handle the stores give the user's code: an inbox handler during a drain,
//! and a transactional workflow step's body during a journal commit, both get an
//! [`ApplyTransaction`] (the store's own connection, inside the transaction the store opened).

use std::cell::{Cell, RefCell, RefMut};
use std::collections::HashMap;

use postgres::types::ToSql;
use postgres::{Client, Row, Statement, ToStatement, Transaction};
use tidemark_core::{Error, Result};

use crate::PgResult;

/// The store's connection while one of its transactions is open on it, as the user's code
/// sees it: an inbox handler during `PgConsumer::drain` (the apply transaction), and a
/// transactional workflow step's body during `PgWorkflows`'s journal commit (inside a savepoint
/// of the commit's transaction). Write your rows with [`ApplyTransaction::execute`] and read with
/// the `query` methods; they commit exactly when the event counts as applied, or with the step's
/// journal entry. Do not end the transaction (`COMMIT`, `ROLLBACK`): the store does. A handler
/// that refuses an event returns `HandleError::Blocked`, and a step body that fails returns a
/// `StepFailure`; either way its writes roll back to a savepoint.
///
/// The same type in both places (as SQLite's stores give both a `rusqlite::Connection`), so a
/// function that writes the user's rows serves an inbox handler and a transactional step alike.
///
/// tidemark's own tables in the store's schema are not for this code to read or write: within
/// one commit the store writes some of their rows together after the user's code ran (the
/// inbox's applied marks and cursors at the end of a drain, the journal entries of a batch
/// before it reads the journal again), so what they show mid-transaction is not defined.
pub struct ApplyTransaction {
    client: RefCell<Client>,
    schema: String,
    /// The user's statements prepared by [`ApplyTransaction::prepare_cached`].
    prepared: RefCell<HashMap<String, Statement>>,
    /// Asked before each of the store's write transactions commits (see [`CommitHook`]).
    commit_hook: RefCell<Option<CommitHook>>,
    /// A statement of the user's code failed since [`ApplyTransaction::begin_user_code`] (the
    /// transaction may be aborted, whatever the code returned).
    user_statement_failed: Cell<bool>,
    /// A savepoint whose release the store has not sent yet ([`ApplyTransaction::defer_release`]):
    /// sent before the store's next statement ([`ApplyTransaction::client`]), or with the next
    /// savepoint's start in one round trip.
    release_pending: Cell<Option<&'static str>>,
}

/// Asked just before each write transaction of a store commits, as SQLite's commit hook is:
/// `true` turns the commit into a rollback and the store's call fails with a `store` error.
/// What a process killed at that commit leaves behind, without killing it: the test kit
/// (`tidemark::testing`) crashes a workflow at each journal boundary in turn with it.
pub type CommitHook = Box<dyn FnMut() -> bool + Send>;

/// The message of a commit a [`CommitHook`] refused.
pub const COMMIT_REFUSED: &str = "postgres: the commit hook turned the commit into a rollback";

/// The most statements [`ApplyTransaction::prepare_cached`] keeps (past it, the cache starts
/// over: a program that formats values into its SQL text cannot grow it without bound).
pub const PREPARED_STATEMENTS_MAX: usize = 256;

impl ApplyTransaction {
    pub(crate) fn new(client: Client, schema: &str) -> Self {
        ApplyTransaction {
            client: RefCell::new(client),
            schema: schema.to_string(),
            prepared: Default::default(),
            commit_hook: RefCell::new(None),
            user_statement_failed: Cell::new(false),
            release_pending: Cell::new(None),
        }
    }

    /// The user's code is about to run: forget earlier statement failures.
    pub(crate) fn begin_user_code(&self) {
        self.user_statement_failed.set(false);
    }

    /// Whether a statement the user's code ran since [`ApplyTransaction::begin_user_code`] failed.
    pub(crate) fn user_statement_failed(&self) -> bool {
        self.user_statement_failed.get()
    }

    /// Release savepoint `name` later: before the store's next statement, or together with the
    /// next savepoint's start ([`ApplyTransaction::take_release`]). Only for a savepoint whose
    /// user code ran no failing statement: what the release would check then is that the code
    /// did not end the transaction, and nothing of the store runs before that check.
    pub(crate) fn defer_release(&self, name: &'static str) {
        self.release_pending.set(Some(name));
    }

    /// The savepoint whose release is pending, taken: the caller sends the release itself.
    pub(crate) fn take_release(&self) -> Option<&'static str> {
        self.release_pending.take()
    }

    /// The connection for the store's next statements, after the pending release (if any) was
    /// sent: a release that fails means the user's code ended the transaction, and the store's
    /// call fails before anything else of it runs.
    pub(crate) fn client(&self) -> Result<RefMut<'_, Client>> {
        let mut client = self.client.borrow_mut();
        if let Some(name) = self.release_pending.take() {
            client.batch_execute(&format!("RELEASE SAVEPOINT {name}")).map_err(|error| {
                Error::store(format!(
                    "the transaction ended inside the body of the user's code that ran in savepoint {name}: {}",
                    Error::from(error)
                ))
            })?;
        }
        Ok(client)
    }

    pub(crate) fn set_commit_hook(&mut self, hook: Option<CommitHook>) {
        *self.commit_hook.get_mut() = hook;
    }

    pub(crate) fn take_commit_hook(&mut self) -> Option<CommitHook> {
        self.commit_hook.get_mut().take()
    }

    /// Whether the commit hook refuses the commit about to happen.
    fn commit_refused(hook: &RefCell<Option<CommitHook>>) -> bool {
        hook.borrow_mut().as_mut().is_some_and(|hook| hook())
    }

    /// A write transaction of the store on its connection, and the gate its commit goes
    /// through ([`CommitGate::commit`] asks the commit hook first).
    pub(crate) fn write_transaction(&mut self) -> Result<(Transaction<'_>, CommitGate<'_>)> {
        let ApplyTransaction { client, commit_hook, .. } = self;
        let tx = client.get_mut().transaction().db()?;
        Ok((tx, CommitGate(commit_hook)))
    }

    /// `statement` prepared once per connection and kept (at most [`PREPARED_STATEMENTS_MAX`]):
    /// pass the answer to [`ApplyTransaction::execute`] or a `query` method to save the
    /// round trip a statement given as text costs to be parsed on every call. A statement whose
    /// tables change shape afterwards (DDL) fails as PostgreSQL says; prepare it again then.
    pub fn prepare_cached(&self, statement: &str) -> Result<Statement, postgres::Error> {
        if let Some(prepared) = self.prepared.borrow().get(statement) {
            return Ok(prepared.clone());
        }
        let prepared = self.with(|c| c.prepare(statement))?;
        let mut cache = self.prepared.borrow_mut();
        if cache.len() >= PREPARED_STATEMENTS_MAX {
            cache.clear();
        }
        cache.insert(statement.to_string(), prepared.clone());
        Ok(prepared)
    }

    /// The store's PostgreSQL schema (where tidemark's tables are; the user's own tables may live
    /// there or anywhere in the same database).
    pub fn schema(&self) -> &str {
        &self.schema
    }

    /// The connection, borrowed for one or more statements of the store. The store never holds
    /// this borrow while the user's code runs, and the user's code cannot reach the store, so it
    /// cannot fail.
    pub(crate) fn client_mut(&self) -> RefMut<'_, Client> {
        self.client.borrow_mut()
    }

    /// The connection, without a run-time borrow (the store holds `&mut self`).
    pub(crate) fn client_get_mut(&mut self) -> &mut Client {
        self.client.get_mut()
    }

    pub(crate) fn with<R>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<R, postgres::Error>,
    ) -> Result<R, postgres::Error> {
        let result = f(&mut self.client.borrow_mut());
        if result.is_err() {
            self.user_statement_failed.set(true);
        }
        result
    }

    /// Run one statement and return the number of rows it changed.
    pub fn execute<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<u64, postgres::Error> {
        self.with(|c| c.execute(statement, params))
    }

    /// Run one query and return its rows.
    pub fn query<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>, postgres::Error> {
        self.with(|c| c.query(statement, params))
    }

    /// Run a query that returns exactly one row.
    pub fn query_one<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Row, postgres::Error> {
        self.with(|c| c.query_one(statement, params))
    }

    /// Run a query that returns at most one row.
    pub fn query_opt<T: ?Sized + ToStatement>(
        &self,
        statement: &T,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<Row>, postgres::Error> {
        self.with(|c| c.query_opt(statement, params))
    }

    /// Run statements separated by `;` without parameters (for example DDL).
    pub fn batch_execute(&self, statements: &str) -> Result<(), postgres::Error> {
        self.with(|c| c.batch_execute(statements))
    }

    pub(crate) fn run(&self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        self.with(|c| c.execute(statement, params)).db()
    }

    pub(crate) fn rows(&self, statement: &Statement, params: &[&(dyn ToSql + Sync)]) -> Result<Vec<Row>> {
        self.with(|c| c.query(statement, params)).db()
    }
}

/// A transaction begun by hand on an [`ApplyTransaction`]'s connection (not a
/// `postgres::Transaction`, which would hold the connection's `&mut` for its whole life while
/// the user's code needs the connection too). Dropped without [`OpenTransaction::commit`] (an
/// error returned with `?`, or a panic of the user's code unwinding through it), it rolls back,
/// so the session is never left idle in a transaction.
pub(crate) struct OpenTransaction<'a> {
    apply: &'a ApplyTransaction,
    open: bool,
}

impl<'a> OpenTransaction<'a> {
    pub(crate) fn begin(apply: &'a ApplyTransaction) -> Result<Self> {
        apply.release_pending.set(None);
        apply.batch_execute("BEGIN").db()?;
        Ok(OpenTransaction { apply, open: true })
    }

    /// Commit, unless the commit hook refuses (then dropped: rolled back).
    pub(crate) fn commit(mut self) -> Result<()> {
        if ApplyTransaction::commit_refused(&self.apply.commit_hook) {
            return Err(Error::store(COMMIT_REFUSED));
        }
        // A savepoint still to release goes with the commit, in the same round trip: if the
        // user's code ended the transaction, the release fails and the commit is not sent.
        let statements = match self.apply.release_pending.take() {
            Some(name) => format!("RELEASE SAVEPOINT {name}; COMMIT"),
            None => "COMMIT".to_string(),
        };
        self.apply.with(|c| c.batch_execute(&statements)).db()?;
        self.open = false;
        Ok(())
    }
}

/// How a store's own write transaction commits: through its [`CommitHook`], if it has one.
pub(crate) struct CommitGate<'a>(&'a RefCell<Option<CommitHook>>);

impl CommitGate<'_> {
    /// Commit `tx`, unless the commit hook refuses (then rolled back, as a dropped
    /// `postgres::Transaction` is).
    pub(crate) fn commit(self, tx: Transaction<'_>) -> Result<()> {
        if ApplyTransaction::commit_refused(self.0) {
            return Err(Error::store(COMMIT_REFUSED));
        }
        tx.commit().db()
    }
}

impl Drop for OpenTransaction<'_> {
    fn drop(&mut self) {
        if self.open {
            // A borrow still held here would mean a panic inside the store's own statement code;
            // the session is then dropped with the store. A failed rollback leaves the session
            // broken, which the next call reports.
            self.apply.release_pending.set(None);
            if let Ok(mut client) = self.apply.client.try_borrow_mut() {
                let _ = client.batch_execute("ROLLBACK");
            }
        }
    }
}
