//! The Rhai script host: one sandboxed engine, the helpers scripts may call,
//! compiled scripts with their content hash, and positioned script errors.
//!
//! Scripts are compiled once; their top-level statements (constants, knobs)
//! run once at load so functions can read them through `global::NAME` or
//! directly, and every entry point is then called with `eval_ast(false)` so
//! top-level statements are *not* re-run on each call (a Rhai trap).

pub mod watch;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use rhai::{CallFnOptions, Dynamic, Engine, EvalAltResult, Position, Scope, AST};
use sha2::{Digest, Sha256};

/// Explicit sandbox limits: debug and release builds of Rhai have different
/// defaults, so every limit is set here.
pub const MAX_OPERATIONS: u64 = 2_000_000;
pub const MAX_CALL_LEVELS: usize = 48;
pub const MAX_EXPR_DEPTH: usize = 64;
pub const MAX_FN_EXPR_DEPTH: usize = 64;
pub const MAX_STRING_SIZE: usize = 64 * 1024;
pub const MAX_ARRAY_SIZE: usize = 100_000;
pub const MAX_MAP_SIZE: usize = 100_000;

/// A script error with the file and position it points at.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
#[error("{file}:{line}:{col}: {msg}")]
pub struct ScriptError {
    pub file: String,
    pub line: usize,
    pub col: usize,
    pub msg: String,
}

impl ScriptError {
    pub fn new(file: &str, pos: Position, msg: impl Into<String>) -> Self {
        ScriptError {
            file: file.to_string(),
            line: pos.line().unwrap_or(0),
            col: pos.position().unwrap_or(0),
            msg: msg.into(),
        }
    }

    /// Turn a Rhai evaluation error into a positioned error. Rhai reports
    /// the innermost position; for errors inside a called function the
    /// message of the wrapping `ErrorInFunctionCall` names the function.
    pub fn from_eval(file: &str, err: &EvalAltResult) -> Self {
        let msg = match err {
            EvalAltResult::ErrorInFunctionCall(name, _, inner, _) => {
                let inner_pos = inner.position();
                let mut e = ScriptError::from_eval(file, inner);
                if inner_pos.is_none() {
                    e = ScriptError::new(file, err.position(), e.msg);
                }
                e.msg = format!("in fn {name}: {}", e.msg);
                return e;
            }
            EvalAltResult::ErrorTooManyOperations(_) => {
                "operation limit exceeded (infinite loop?)".to_string()
            }
            other => strip_position(&other.to_string()),
        };
        ScriptError::new(file, err.position(), msg)
    }
}

/// Rhai appends " (line L, position P)" to messages; we print it in front.
fn strip_position(msg: &str) -> String {
    match msg.rfind(" (line ") {
        Some(i) if msg.ends_with(')') => msg[..i].to_string(),
        _ => msg.to_string(),
    }
}

/// Host-side effects of helper calls: metrics and log lines, drained by the
/// run loop after each script call.
#[derive(Debug, Default, Clone)]
pub struct Effects {
    pub metrics: Vec<(String, f64)>,
    pub logs: Vec<String>,
}

/// State shared between the engine's registered helpers and the host.
#[derive(Clone)]
pub struct HostHandles {
    rng: Arc<Mutex<ChaCha8Rng>>,
    effects: Arc<Mutex<Effects>>,
}

impl HostHandles {
    /// Reseed the script RNG. The run loop reseeds from (seed, step, stream)
    /// before each call site, so script randomness does not depend on how
    /// many draws an earlier version of a script made (reload-proof).
    pub fn reseed(&self, seed: u64) {
        *self.rng.lock().expect("rng lock") = ChaCha8Rng::seed_from_u64(seed);
    }

    pub fn take_effects(&self) -> Effects {
        std::mem::take(&mut *self.effects.lock().expect("effects lock"))
    }
}

/// Build the sandboxed engine with the actguide helper API registered.
pub fn new_engine() -> (Engine, HostHandles) {
    let (mut engine, handles) = base_engine();
    // No dynamic code in strategy scripts: `eval` could bypass the
    // compile-time checks and positions.
    engine.disable_symbol("eval");
    (engine, handles)
}

fn base_engine() -> (Engine, HostHandles) {
    let mut engine = Engine::new();
    engine
        .set_max_operations(MAX_OPERATIONS)
        .set_max_call_levels(MAX_CALL_LEVELS)
        .set_max_expr_depths(MAX_EXPR_DEPTH, MAX_FN_EXPR_DEPTH)
        .set_max_string_size(MAX_STRING_SIZE)
        .set_max_array_size(MAX_ARRAY_SIZE)
        .set_max_map_size(MAX_MAP_SIZE)
        .set_max_modules(16)
        .set_max_variables(1024)
        .set_max_functions(512);
    // No module resolver by default: scripts cannot read files.
    engine.set_module_resolver(rhai::module_resolvers::DummyModuleResolver::new());

    let handles = HostHandles {
        rng: Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(0))),
        effects: Arc::new(Mutex::new(Effects::default())),
    };

    let rng = handles.rng.clone();
    engine.register_fn("gaussian", move |mu: f64, sigma: f64| -> f64 {
        let sigma = if sigma.is_finite() && sigma > 0.0 {
            sigma
        } else {
            0.0
        };
        if sigma == 0.0 {
            return mu;
        }
        let n = Normal::new(mu, sigma).expect("finite sigma");
        n.sample(&mut *rng.lock().expect("rng lock"))
    });
    let rng = handles.rng.clone();
    engine.register_fn("uniform", move |a: f64, b: f64| -> f64 {
        if b <= a {
            return a;
        }
        rng.lock().expect("rng lock").random_range(a..b)
    });
    engine.register_fn("clamp", |x: f64, lo: f64, hi: f64| x.max(lo).min(hi));
    engine.register_fn("clamp", |x: i64, lo: i64, hi: i64| x.max(lo).min(hi));
    engine.register_fn("ema", |old: f64, new: f64, alpha: f64| {
        (1.0 - alpha) * old + alpha * new
    });
    engine.register_fn("sign", |x: f64| {
        if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            0.0
        }
    });
    let eff = handles.effects.clone();
    engine.register_fn("metric", move |name: &str, value: f64| {
        eff.lock()
            .expect("effects lock")
            .metrics
            .push((name.to_string(), value));
    });
    let eff = handles.effects.clone();
    engine.register_fn("metric", move |name: &str, value: i64| {
        eff.lock()
            .expect("effects lock")
            .metrics
            .push((name.to_string(), value as f64));
    });
    let eff = handles.effects.clone();
    engine.register_fn("log", move |msg: &str| {
        eff.lock().expect("effects lock").logs.push(msg.to_string());
    });
    // `print` and `debug` go to the run log too, never straight to stdout.
    let eff = handles.effects.clone();
    engine.on_print(move |s| eff.lock().expect("effects lock").logs.push(s.to_string()));
    let eff = handles.effects.clone();
    engine.on_debug(move |s, _, _| eff.lock().expect("effects lock").logs.push(s.to_string()));

    crate::guidance::spec::register(&mut engine);
    (engine, handles)
}

/// A compiled script: source, AST, content hash, and the scope holding its
/// top-level constants.
#[derive(Clone)]
pub struct Script {
    pub path: PathBuf,
    pub source: String,
    pub hash: String,
    ast: AST,
    scope: Scope<'static>,
}

impl std::fmt::Debug for Script {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Script")
            .field("path", &self.path)
            .field("hash", &self.hash)
            .finish()
    }
}

/// Short content hash identifying a script version in metrics and run dirs.
pub fn content_hash(source: &str) -> String {
    let digest = Sha256::digest(source.as_bytes());
    digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

impl Script {
    /// Read and compile a script file.
    pub fn load(engine: &Engine, path: &Path) -> Result<Self, ScriptError> {
        let source = std::fs::read_to_string(path).map_err(|e| ScriptError {
            file: path.display().to_string(),
            line: 0,
            col: 0,
            msg: format!("cannot read script: {e}"),
        })?;
        Script::compile(engine, path, source)
    }

    /// Compile source text; runs the top-level statements once (constants).
    pub fn compile(engine: &Engine, path: &Path, source: String) -> Result<Self, ScriptError> {
        let file = path.display().to_string();
        let parse_err = |e: rhai::ParseError| {
            ScriptError::new(&file, e.position(), strip_position(&e.0.to_string()))
        };
        let mut ast = engine.compile(&source).map_err(parse_err)?;
        ast.set_source(file.as_str());
        let mut scope = Scope::new();
        engine
            .run_ast_with_scope(&mut scope, &ast)
            .map_err(|e| ScriptError::from_eval(&file, &e))?;
        // Rhai functions cannot read top-level variables; constants reach
        // them only by the optimiser's propagation. Recompiling with the
        // evaluated constants in scope makes every top-level `const` (the
        // strategy's knobs) visible inside every function.
        let mut consts = Scope::new();
        for (name, is_const, value) in scope.iter() {
            if is_const {
                consts.push_constant(name, value);
            }
        }
        let mut ast = engine
            .compile_with_scope(&consts, &source)
            .map_err(parse_err)?;
        ast.set_source(file.as_str());
        Ok(Script {
            path: path.to_path_buf(),
            hash: content_hash(&source),
            source,
            ast,
            scope,
        })
    }

    pub fn file(&self) -> String {
        self.path.display().to_string()
    }

    /// Does the script define `name` with `arity` parameters?
    pub fn has_fn(&self, name: &str, arity: usize) -> bool {
        self.ast
            .iter_functions()
            .any(|f| f.name == name && f.params.len() == arity)
    }

    /// Call an entry point without re-running top-level statements.
    pub fn call(
        &mut self,
        engine: &Engine,
        name: &str,
        args: impl rhai::FuncArgs,
    ) -> Result<Dynamic, ScriptError> {
        let opts = CallFnOptions::new().eval_ast(false).rewind_scope(true);
        engine
            .call_fn_with_options::<Dynamic>(opts, &mut self.scope, &self.ast, name, args)
            .map_err(|e| ScriptError::from_eval(&self.file(), &e))
    }
}

/// Convert a serde value into a Rhai value (task and batch views).
pub fn to_dynamic<T: serde::Serialize>(v: &T) -> Dynamic {
    rhai::serde::to_dynamic(v).unwrap_or(Dynamic::UNIT)
}
