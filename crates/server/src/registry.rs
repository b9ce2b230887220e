//! What a service serves: the user's flow machines, consumer handlers, workflows and table
//! migrations, checked once when the service is built ([`crate::ServiceBuilder::build`]) and
//! shared by every tenant. The built-in domain of `tidemark serve` is registered here through the
//! same calls a user makes (`tidemark-builtins`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use serde::Serialize;
use tidemark_core::endpoint::{mask, Endpoint, EndpointKind};
use tidemark_core::error::codes;
use tidemark_core::flow::{FlowMachine, MachineSet, StreamMachine};
use tidemark_core::id::validate_id;
use tidemark_core::store::Subscription;
use tidemark_core::{Error, Result};
use tidemark_engine::workflow::{Workflow, Workflows};
use tidemark_store_sqlite::Durability;
use utoipa::ToSchema;

use crate::backend::Backend;
use crate::tenant::BoxedHandler;

/// Makes one handler per tenant (handlers are `&mut self`: each tenant's inbox thread owns its
/// own).
pub(crate) type MakeHandler<B> = Arc<dyn Fn() -> BoxedHandler<B> + Send + Sync>;

/// The workflows of one tenant, made when the tenant opens (for workflows that need a resource of
/// their own per tenant, such as the built-in fake payment service's log).
pub(crate) type MakeWorkflows<B> =
    Arc<dyn Fn(&TenantInfo) -> Result<Vec<Workflow<<B as Backend>::Workflows>>> + Send + Sync>;

/// The tenant's SQLite databases, by what they hold. Each has its own writer thread, and a
/// transaction never spans two of them: put a table in the database whose transaction must
/// change it (docs/library.md, "Where your tables live").
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Database {
    /// `producer.db`: flows and the outbox. Tables written together with a flow's event
    /// ([`crate::Tenant::transaction`]).
    Producer,
    /// `inbox.db`: the inboxes of consumers whose handlers project into it (the default for
    /// handlers). Tables a handler writes in the apply transaction.
    Inbox,
    /// `workflows.db`: runs and journals, and the inbox of handlers that wake runs. Tables a
    /// workflow's transactional steps (`ctx.tx_step`) write.
    Workflows,
}

impl Database {
    /// The file's name in the tenant's folder.
    pub fn file_name(self) -> &'static str {
        match self {
            Database::Producer => "producer.db",
            Database::Inbox => "inbox.db",
            Database::Workflows => "workflows.db",
        }
    }

    /// Its name in the registry and in errors.
    pub fn as_str(self) -> &'static str {
        match self {
            Database::Producer => "producer",
            Database::Inbox => "inbox",
            Database::Workflows => "workflows",
        }
    }
}

/// What a per-tenant registration is told about the tenant being opened.
#[derive(Debug, Clone)]
pub struct TenantInfo {
    /// The tenant's id.
    pub id: String,
    /// The tenant's folder (its databases are in it; a registration may keep files of its own
    /// there too).
    pub dir: PathBuf,
    /// The configured durability.
    pub durability: Durability,
}

pub(crate) struct HandlerEntry<B: Backend> {
    pub(crate) database: Database,
    pub(crate) make: MakeHandler<B>,
}

/// A consumer the service declares in every tenant (and, unless its events come from other
/// services only, subscribes to the tenant's outboxes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ConsumerDeclaration {
    pub(crate) consumer_id: String,
    pub(crate) handler: String,
    /// Subscribed to the tenant's own outboxes (false: fed by other services' relays or a source).
    pub(crate) subscribe: bool,
}

pub(crate) struct TenantWorkflows<B: Backend> {
    pub(crate) declared: Vec<(String, u32)>,
    pub(crate) make: MakeWorkflows<B>,
}

/// What a service serves, checked, as every tenant and route sees it (whatever the backend).
pub struct Registry {
    pub(crate) machines: MachineSet,
    /// Each handler's database, by handler name.
    pub(crate) handlers: BTreeMap<String, Database>,
    pub(crate) consumers: Vec<ConsumerDeclaration>,
    /// Network endpoints subscribed to every tenant's outboxes when it opens.
    pub(crate) subscriptions: Vec<Subscription>,
    /// Every workflow name and version a tenant has (the per-tenant ones as declared), sorted.
    pub(crate) workflow_names: Vec<(String, u32)>,
}

/// The checked registrations of a service on backend `B`: what a tenant is opened with (the
/// handlers, workflows and migrations, typed by the backend's transaction).
pub struct Registrations<B: Backend> {
    pub(crate) machines: MachineSet,
    pub(crate) handlers: BTreeMap<String, HandlerEntry<B>>,
    pub(crate) workflows: Workflows<B::Workflows>,
    pub(crate) tenant_workflows: Vec<TenantWorkflows<B>>,
    pub(crate) migrations: BTreeMap<Database, Vec<B::Migration>>,
    /// Queues declared in every tenant's workflow database when it opens.
    pub(crate) queues: Vec<tidemark_core::queue::QueueSpec>,
}

/// A registered machine as `GET /v1/registry` lists it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct MachineInfo {
    /// The machine's name.
    pub name: String,
    /// Its states, the initial one included.
    pub states: Vec<String>,
    /// The state of a flow without events.
    pub initial: String,
    /// Whether an advance may leave out the seq it last saw (an event stream).
    pub appends_at_any_seq: bool,
}

/// A registered handler as `GET /v1/registry` lists it.
#[derive(Debug, Clone, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HandlerInfo {
    /// The handler's name (what a consumer is declared with).
    pub name: String,
    /// The database its consumers' inboxes (and the tables it writes) are in.
    pub database: Database,
}

impl Registry {
    /// Check and assemble the registrations of a builder.
    pub(crate) fn new<B: Backend>(parts: RegistryParts<B>) -> Result<(Registry, Registrations<B>)> {
        let mut machines = MachineSet::new();
        // Every service serves plain event streams (`POST /v1/streams/{flow}/events`).
        machines.add(Arc::new(StreamMachine))?;
        for machine in parts.machines {
            machines.add(machine)?;
        }
        let mut handlers = BTreeMap::new();
        for (name, entry) in parts.handlers {
            validate_id("handler", &name)?;
            if handlers.insert(name.clone(), entry).is_some() {
                return Err(Error::invalid(codes::ALREADY_EXISTS, format!("handler {name:?} is registered twice")));
            }
        }
        let mut declared = BTreeSet::new();
        for consumer in &parts.consumers {
            validate_id("consumer_id", &consumer.consumer_id)?;
            if !handlers.contains_key(&consumer.handler) {
                return Err(Error::invalid(
                    codes::UNKNOWN_HANDLER,
                    format!(
                        "consumer {:?} names handler {:?}, which is not registered; registered: {}",
                        consumer.consumer_id,
                        consumer.handler,
                        handlers.keys().cloned().collect::<Vec<_>>().join(", ")
                    ),
                ));
            }
            if !declared.insert(consumer.consumer_id.clone()) {
                return Err(Error::invalid(
                    codes::ALREADY_EXISTS,
                    format!("consumer {:?} is declared twice", consumer.consumer_id),
                ));
            }
        }
        // A subscriber id names one subscription of the outboxes: a declared consumer fed by them
        // has one already. (A consumer fed from elsewhere may share its id with a subscriber: its
        // id is the dedup identity of an inbox here, the subscriber's of someone else's.)
        let mut subscribers: BTreeSet<&str> =
            parts.consumers.iter().filter(|c| c.subscribe).map(|c| c.consumer_id.as_str()).collect();
        for subscription in &parts.subscriptions {
            validate_id("consumer_id", &subscription.consumer_id)?;
            // A file endpoint is one of the tenant's own databases: a declared consumer.
            if Endpoint::parse(&subscription.endpoint)?.kind() == EndpointKind::Sqlite {
                return Err(Error::invalid(
                    codes::INVALID_ENDPOINT,
                    format!(
                        "subscription {:?}: {} is a file; declare a consumer for the tenant's own databases",
                        subscription.consumer_id,
                        mask(&subscription.endpoint)
                    ),
                ));
            }
            if !subscribers.insert(&subscription.consumer_id) {
                return Err(Error::invalid(
                    codes::ALREADY_EXISTS,
                    format!(
                        "subscriber {:?} is subscribed twice (or also a declared consumer fed by the outboxes)",
                        subscription.consumer_id
                    ),
                ));
            }
        }
        let mut workflows = Workflows::new();
        for workflow in parts.workflows {
            workflows.add(workflow?)?;
        }
        // Per-tenant workflows declare their names and versions, so that a clash is found here
        // and not when a tenant opens.
        let mut names: BTreeSet<(String, u32)> =
            workflows.versions().into_iter().map(|v| (v.workflow, v.version)).collect();
        for group in &parts.tenant_workflows {
            for (name, version) in &group.declared {
                validate_id("workflow", name)?;
                if !names.insert((name.clone(), *version)) {
                    return Err(Error::invalid(
                        codes::ALREADY_EXISTS,
                        format!("workflow {name} v{version} is already registered"),
                    ));
                }
            }
        }
        let mut migrations: BTreeMap<Database, Vec<B::Migration>> = BTreeMap::new();
        for (database, migration) in parts.migrations {
            migrations.entry(database).or_default().push(migration);
        }
        for list in migrations.values() {
            B::validate_migrations(list)?;
        }
        let mut queue_names = BTreeSet::new();
        for queue in &parts.queues {
            queue.validate()?;
            if !queue_names.insert(queue.name.clone()) {
                return Err(Error::invalid(codes::ALREADY_EXISTS, format!("queue {:?} is declared twice", queue.name)));
            }
        }
        let workflow_names: Vec<(String, u32)> = names.into_iter().collect();
        let registry = Registry {
            machines: machines.clone(),
            handlers: handlers.iter().map(|(name, entry)| (name.clone(), entry.database)).collect(),
            consumers: parts.consumers,
            subscriptions: parts.subscriptions,
            workflow_names,
        };
        let registrations = Registrations {
            machines,
            handlers,
            workflows,
            tenant_workflows: parts.tenant_workflows,
            migrations,
            queues: parts.queues,
        };
        Ok((registry, registrations))
    }

    /// The machines (the built-in event stream first).
    pub fn machines(&self) -> &MachineSet {
        &self.machines
    }

    /// The machines as the registry route lists them.
    pub fn machine_infos(&self) -> Vec<MachineInfo> {
        self.machines
            .machines()
            .iter()
            .map(|m| MachineInfo {
                name: m.name().to_string(),
                states: m.states().into_iter().map(str::to_string).collect(),
                initial: m.initial().state,
                appends_at_any_seq: m.appends_at_any_seq(),
            })
            .collect()
    }

    /// The handlers as the registry route lists them.
    pub fn handler_infos(&self) -> Vec<HandlerInfo> {
        self.handlers.iter().map(|(name, database)| HandlerInfo { name: name.clone(), database: *database }).collect()
    }

    /// The database of handler `name`, or `unknown_handler`.
    pub fn handler_database(&self, name: &str) -> Result<Database> {
        self.handlers.get(name).copied().ok_or_else(|| {
            Error::invalid(
                codes::UNKNOWN_HANDLER,
                format!(
                    "handler {name:?} is not registered; registered: {}",
                    self.handlers.keys().cloned().collect::<Vec<_>>().join(", ")
                ),
            )
        })
    }

    /// Every workflow name and version a tenant will have (the per-tenant ones as declared).
    pub fn workflow_names(&self) -> Vec<(String, u32)> {
        self.workflow_names.clone()
    }
}

impl<B: Backend> Registrations<B> {
    /// The handlers of one database, one instance each, for a tenant's inbox thread.
    pub(crate) fn handlers_of(&self, database: Database) -> BTreeMap<String, BoxedHandler<B>> {
        self.handlers.iter().filter(|(_, h)| h.database == database).map(|(n, h)| (n.clone(), (h.make)())).collect()
    }

    /// The workflows of a tenant: the shared ones and those its per-tenant registrations make.
    pub(crate) fn workflows_for(&self, tenant: &TenantInfo) -> Result<Workflows<B::Workflows>> {
        let mut workflows = self.workflows.clone();
        for group in &self.tenant_workflows {
            let made = (group.make)(tenant)?;
            let mut got: Vec<(String, u32)> = made.iter().map(|w| (w.name().to_string(), w.version())).collect();
            let mut declared = group.declared.clone();
            got.sort();
            declared.sort();
            if got != declared {
                return Err(Error::Invariant(format!(
                    "a per-tenant workflow registration declared {declared:?} but made {got:?}"
                )));
            }
            for workflow in made {
                workflows.add(workflow)?;
            }
        }
        Ok(workflows)
    }

    /// The user migrations of one database, in order.
    pub(crate) fn migrations_of(&self, database: Database) -> &[B::Migration] {
        self.migrations.get(&database).map_or(&[], Vec::as_slice)
    }
}

/// What a builder collected, before it is checked.
pub(crate) struct RegistryParts<B: Backend> {
    pub(crate) machines: Vec<Arc<dyn FlowMachine>>,
    pub(crate) handlers: Vec<(String, HandlerEntry<B>)>,
    pub(crate) consumers: Vec<ConsumerDeclaration>,
    pub(crate) subscriptions: Vec<Subscription>,
    pub(crate) workflows: Vec<Result<Workflow<B::Workflows>>>,
    pub(crate) tenant_workflows: Vec<TenantWorkflows<B>>,
    pub(crate) migrations: Vec<(Database, B::Migration)>,
    pub(crate) queues: Vec<tidemark_core::queue::QueueSpec>,
}

impl<B: Backend> Default for RegistryParts<B> {
    fn default() -> Self {
        RegistryParts {
            machines: Vec::new(),
            handlers: Vec::new(),
            consumers: Vec::new(),
            subscriptions: Vec::new(),
            workflows: Vec::new(),
            tenant_workflows: Vec::new(),
            migrations: Vec::new(),
            queues: Vec::new(),
        }
    }
}
