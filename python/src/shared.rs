//! What a switch shares with every tensor handed out from it: the switch itself (its memory),
//! the session token and the leases. Each holder keeps one strong reference ([`Owner`]), so the
//! memory a view reads is freed only after the last of the Python switch, its handles and every
//! exported DLPack view (numpy's `base`, torch's storage) is gone, in whatever order they go.
//!
//! Deleters may run on any thread without the GIL (torch calls them from its own threads): what
//! they drop needs no Python, and from the interpreter's exit handlers on ([`finalizing`]) they
//! free nothing at all, since the CUDA driver may already be torn down; the process is ending.

use std::mem::ManuallyDrop;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use lifecycle_bridge::{Lease, Leases, Switch};

/// Which session and weight generation are current.
#[derive(Debug, Default)]
pub struct Token {
    /// The open session's id (0: none).
    pub session: AtomicU64,
    /// The generation of the resident weights.
    pub generation: AtomicU64,
}

/// The switch and its bookkeeping, shared by the `_Switch`, its handles and its exports.
pub struct Shared {
    inner: Mutex<Switch>,
    /// Which session and generation are current.
    pub token: Token,
    /// Sessions opened so far (the next one's id is one more).
    pub sessions: AtomicU64,
    /// The handed-out views still referenced.
    pub leases: Arc<Leases>,
}

impl Shared {
    /// `inner`, with its leases.
    pub fn new(inner: Switch) -> Arc<Self> {
        let leases = inner.leases();
        Arc::new(Shared {
            inner: Mutex::new(inner),
            token: Token::default(),
            sessions: AtomicU64::new(0),
            leases,
        })
    }

    /// The switch, locked (a panic elsewhere does not make it unusable: every call checks its
    /// own preconditions).
    pub fn lock(&self) -> MutexGuard<'_, Switch> {
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

static FINALIZING: AtomicBool = AtomicBool::new(false);

/// Whether the interpreter has begun to exit (its exit handlers ran `_finalizing`).
pub fn finalizing() -> bool {
    FINALIZING.load(Ordering::SeqCst)
}

/// Marks the interpreter as exiting: from now on nothing shared is freed (registered with
/// `atexit` by the package).
#[pyo3::pyfunction]
pub fn _finalizing() {
    FINALIZING.store(true, Ordering::SeqCst);
}

/// One strong reference to a [`Shared`], dropped without unwinding and not at all once the
/// interpreter exits.
pub struct Owner(ManuallyDrop<Arc<Shared>>);

impl Owner {
    /// A new reference to `shared`.
    pub fn new(shared: &Arc<Shared>) -> Self {
        Owner(ManuallyDrop::new(shared.clone()))
    }

    /// The shared switch, to hand a new reference on.
    pub fn shared(&self) -> &Arc<Shared> {
        &self.0
    }
}

impl std::ops::Deref for Owner {
    type Target = Shared;

    fn deref(&self) -> &Shared {
        &self.0
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        if finalizing() {
            // Leaked on purpose: the process is ending and the CUDA driver may be gone.
            return;
        }
        // SAFETY: the only place the reference is taken out, once, as the Owner goes.
        let last = unsafe { ManuallyDrop::take(&mut self.0) };
        // A deleter must not unwind into its (C) caller; freeing memory reports nothing here.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(last)));
    }
}

/// What an exported DLPack view owns: its lease (so an explicit exit, refresh or close is
/// refused while it lives) and a reference that keeps its memory alive.
pub struct Keep {
    _lease: Lease,
    _owner: Owner,
}

impl Keep {
    /// A lease on view `name` of `shared`, keeping `shared` alive.
    pub fn new(shared: &Arc<Shared>, name: &str) -> Self {
        // the lease goes first when dropped (fields drop in order), then the memory
        Keep {
            _lease: Leases::take(&shared.leases, name),
            _owner: Owner::new(shared),
        }
    }
}
