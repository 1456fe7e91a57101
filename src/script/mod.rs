//! The Rhai script runtime: one sandboxed engine, the helpers scripts may call,
//! compiled scripts with their content hash, and positioned script errors.
//!
//! Scripts are compiled once; their top-level statements (constants, knobs,
//! imports) run at load, the engine serves each file's constants to that
//! file's functions, and every entry point is then called with
//! `eval_ast(false)` so top-level statements are *not* re-run on each call
//! (a Rhai trap). `import "guidance/gaussian" as g;` resolves against the
//! importing script's directory; the imported files are part of the
//! version's hash and of the set of files hot reload watches.

pub mod watch;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

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
/// Default wall-clock budget of one script call (`guidance.call_budget_s`).
pub const DEFAULT_CALL_BUDGET_S: f64 = 10.0;

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
            EvalAltResult::ErrorInFunctionCall(name, src, inner, _) => {
                // Errors inside an imported module's function name its file.
                let file = if src.is_empty() { file } else { src.as_str() };
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
            // The wall-clock budget's message travels as the token.
            EvalAltResult::ErrorTerminated(token, _) if token.is_string() => token.to_string(),
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

/// Runtime-side effects of helper calls: metrics and log lines, drained by the
/// run loop after each script call.
#[derive(Debug, Default, Clone)]
pub struct Effects {
    pub metrics: Vec<(String, f64)>,
    pub logs: Vec<String>,
    /// `metric()` calls and log lines over the per-step caps
    /// ([`MAX_METRICS_PER_STEP`], [`MAX_LOGS_PER_STEP`]), dropped.
    pub dropped_metrics: usize,
    pub dropped_logs: usize,
}

/// Most `metric()` values a step keeps (they all go into one metrics line).
pub const MAX_METRICS_PER_STEP: usize = 1024;
/// Most script log lines (`log`, `print`, `debug`) a step keeps.
pub const MAX_LOGS_PER_STEP: usize = 200;
/// Longest metric name and log line kept, in characters (longer ones are cut).
pub const MAX_EFFECT_CHARS: usize = 1000;

impl Effects {
    fn metric(&mut self, name: &str, value: f64) {
        if self.metrics.len() >= MAX_METRICS_PER_STEP {
            self.dropped_metrics += 1;
        } else {
            self.metrics
                .push((name.chars().take(MAX_EFFECT_CHARS).collect(), value));
        }
    }

    fn log(&mut self, line: &str) {
        if self.logs.len() >= MAX_LOGS_PER_STEP {
            self.dropped_logs += 1;
        } else {
            self.logs
                .push(line.chars().take(MAX_EFFECT_CHARS).collect());
        }
    }
}

/// State shared between the engine's registered helpers and the runtime.
#[derive(Clone)]
pub struct ScriptHandles {
    rng: Arc<Mutex<ChaCha8Rng>>,
    effects: Arc<Mutex<Effects>>,
    budget: Arc<Mutex<CallBudget>>,
    registrars: Vec<Registrar>,
}

/// Registers a higher layer's types and functions on every engine built
/// from a [`ScriptHandles`] (guidance adds its `Spec` constructors this way),
/// so this layer names nothing above it.
pub type Registrar = fn(&mut Engine);

/// The wall-clock budget of script calls: the operation limit bounds work,
/// this bounds time (a slow but valid call is stopped too).
#[derive(Debug, Clone, Copy)]
struct CallBudget {
    limit: std::time::Duration,
    /// When the call in progress must end (none between calls).
    deadline: Option<std::time::Instant>,
}

impl ScriptHandles {
    /// Reseed the script RNG. The run loop reseeds from (seed, step, stream)
    /// before each call site, so script randomness does not depend on how
    /// many draws an earlier version of a script made (reload-proof).
    pub fn reseed(&self, seed: u64) {
        *self.rng.lock().expect("rng lock") = ChaCha8Rng::seed_from_u64(seed);
    }

    /// Set the wall-clock budget of every later script call.
    pub fn set_call_budget(&self, limit: std::time::Duration) {
        self.budget.lock().expect("budget lock").limit = limit;
    }

    pub fn take_effects(&self) -> Effects {
        std::mem::take(&mut *self.effects.lock().expect("effects lock"))
    }
}

impl ScriptHandles {
    /// Fresh handles: a script RNG (reseeded per call site) and an effects
    /// buffer.
    pub fn new() -> Self {
        ScriptHandles {
            rng: Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(0))),
            effects: Arc::new(Mutex::new(Effects::default())),
            budget: Arc::new(Mutex::new(CallBudget {
                limit: std::time::Duration::from_secs_f64(DEFAULT_CALL_BUDGET_S),
                deadline: None,
            })),
            registrars: Vec::new(),
        }
    }

    /// These handles with `r` run on every engine built from them.
    pub fn with_registrar(mut self, r: Registrar) -> Self {
        self.registrars.push(r);
        self
    }
}

impl Default for ScriptHandles {
    fn default() -> Self {
        ScriptHandles::new()
    }
}

/// A sandboxed engine with no imports over `handles` (their registrars
/// included): experiment files are evaluated on one.
pub fn engine(handles: &ScriptHandles) -> Engine {
    engine_with(handles, None)
}

/// The sandboxed engine of one script version. `imports` is the resolver of
/// `import "guidance/gaussian" as g;` statements (relative to the root
/// scripts directory); without it scripts cannot read any file.
fn engine_with(handles: &ScriptHandles, imports: Option<ImportResolver>) -> Engine {
    let mut engine = Engine::new();
    engine
        .set_max_operations(MAX_OPERATIONS)
        .set_max_call_levels(MAX_CALL_LEVELS)
        .set_max_expr_depths(MAX_EXPR_DEPTH, MAX_FN_EXPR_DEPTH)
        .set_max_string_size(MAX_STRING_SIZE)
        .set_max_array_size(MAX_ARRAY_SIZE)
        .set_max_map_size(MAX_MAP_SIZE)
        .set_max_modules(32)
        .set_max_variables(1024)
        .set_max_functions(512);
    // Every 4096 operations, check the call's wall-clock deadline.
    let budget = handles.budget.clone();
    engine.on_progress(move |ops| {
        if ops % 4096 != 0 {
            return None;
        }
        let b = *budget.lock().expect("budget lock");
        match b.deadline {
            Some(d) if std::time::Instant::now() > d => Some(Dynamic::from(format!(
                "the call ran over its wall-clock budget of {} s (guidance.call_budget_s)",
                b.limit.as_secs_f64()
            ))),
            _ => None,
        }
    });
    // No dynamic code in strategy scripts: `eval` could bypass the
    // compile-time checks and positions.
    engine.disable_symbol("eval");
    // A misspelt field of a task, group or batch view is an error, not a
    // silent `()` that fails later with a cryptic message.
    engine.set_fail_on_invalid_map_property(true);
    match imports {
        Some(r) => {
            let consts = r.consts.clone();
            // The innermost namespace is the file of the running function.
            #[allow(deprecated)] // `on_var` is stable in use, marked volatile
            engine.on_var(move |name, _, ctx| {
                let file = ctx
                    .iter_namespaces()
                    .last()
                    .and_then(|m| m.id())
                    .or(ctx.source())
                    .unwrap_or("");
                Ok(consts.read().expect("constants lock").get(file, name))
            });
            engine.set_module_resolver(r)
        }
        None => engine.set_module_resolver(rhai::module_resolvers::DummyModuleResolver::new()),
    };

    let rng = handles.rng.clone();
    engine.register_fn(
        "gaussian",
        move |mu: f64, sigma: f64| -> Result<f64, Box<EvalAltResult>> {
            if !mu.is_finite() || !sigma.is_finite() {
                return Err(format!("gaussian({mu}, {sigma}): arguments must be finite").into());
            }
            if sigma <= 0.0 {
                return Ok(mu);
            }
            let n = Normal::new(mu, sigma).map_err(|e| e.to_string())?;
            Ok(n.sample(&mut *rng.lock().expect("rng lock")))
        },
    );
    let rng = handles.rng.clone();
    engine.register_fn(
        "uniform",
        move |a: f64, b: f64| -> Result<f64, Box<EvalAltResult>> {
            if !a.is_finite() || !b.is_finite() {
                return Err(format!("uniform({a}, {b}): arguments must be finite").into());
            }
            if b <= a {
                return Ok(a);
            }
            Ok(rng.lock().expect("rng lock").random_range(a..b))
        },
    );
    engine.register_fn("clamp", |x: f64, lo: f64, hi: f64| x.max(lo).min(hi));
    engine.register_fn("clamp", |x: i64, lo: i64, hi: i64| x.max(lo).min(hi));
    // `clamp(r, 0, 1)` with a float r: integer bounds are a common slip.
    engine.register_fn("clamp", |x: f64, lo: i64, hi: i64| {
        x.max(lo as f64).min(hi as f64)
    });
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
        eff.lock().expect("effects lock").metric(name, value);
    });
    let eff = handles.effects.clone();
    engine.register_fn("metric", move |name: &str, value: i64| {
        eff.lock().expect("effects lock").metric(name, value as f64);
    });
    let eff = handles.effects.clone();
    engine.register_fn("log", move |msg: &str| {
        eff.lock().expect("effects lock").log(msg);
    });
    // `print` and `debug` go to the run log too, never straight to stdout.
    let eff = handles.effects.clone();
    engine.on_print(move |s| eff.lock().expect("effects lock").log(s));
    let eff = handles.effects.clone();
    engine.on_debug(move |s, _, _| eff.lock().expect("effects lock").log(s));

    for register in &handles.registrars {
        register(&mut engine);
    }
    engine
}

/// Files an import resolver has read (path, source), in first-read order,
/// and the first error it met (with the imported file's position).
#[derive(Debug, Default)]
struct ImportLog {
    files: Vec<(PathBuf, String)>,
    /// Functions of each imported file, in first-import order.
    asts: Vec<(String, AST)>,
    /// Each file is compiled once per version: the top-level statements
    /// run twice (constants, then as a module), the imports resolve once.
    modules: HashMap<PathBuf, Arc<rhai::Module>>,
    error: Option<ScriptError>,
}

/// Resolves `import "name" as m;` to `<root>/name.rhai`. Each imported file
/// gets the same treatment as a main script: its top-level constants are
/// visible inside its functions.
#[derive(Clone)]
struct ImportResolver {
    root: PathBuf,
    log: Arc<Mutex<ImportLog>>,
    consts: ConstTable,
}

impl rhai::ModuleResolver for ImportResolver {
    fn resolve(
        &self,
        engine: &Engine,
        _source: Option<&str>,
        path: &str,
        pos: Position,
    ) -> Result<Arc<rhai::Module>, Box<EvalAltResult>> {
        let mut file = self.root.join(path);
        if file.extension().is_none() {
            file.set_extension("rhai");
        }
        let fail = |e: ScriptError| -> Box<EvalAltResult> {
            let msg = e.to_string();
            let mut log = self.log.lock().expect("import log");
            if log.error.is_none() {
                log.error = Some(e);
            }
            EvalAltResult::ErrorModuleNotFound(format!("{path} ({msg})"), pos).into()
        };
        if let Some(m) = self.log.lock().expect("import log").modules.get(&file) {
            return Ok(m.clone());
        }
        let source = std::fs::read_to_string(&file).map_err(|e| {
            // Point at the import statement of the importing file.
            fail(ScriptError::new(
                _source.unwrap_or("-"),
                pos,
                format!("cannot import \"{path}\" ({}): {e}", file.display()),
            ))
        })?;
        let name = file.display().to_string();
        let ast = compile_with_constants(engine, &self.consts, &name, &source).map_err(fail)?;
        let module: Arc<rhai::Module> = rhai::Module::eval_ast_as_new(Scope::new(), &ast, engine)
            .map_err(|e| fail(ScriptError::from_eval(&name, &e)))?
            .into();
        let mut log = self.log.lock().expect("import log");
        log.files.push((file.clone(), source));
        log.asts.push((name, ast.clone_functions_only()));
        log.modules.insert(file, module.clone());
        Ok(module)
    }
}

/// Top-level constants of each file of a script version, by file name.
#[derive(Default)]
struct Consts {
    by_file: HashMap<String, HashMap<String, Dynamic>>,
    /// The main file, and its imports in first-import order: functions of
    /// the main file (imported ones included, see [`Script::compile`]) see
    /// the main file's constants first, then those of later imports before
    /// earlier ones — so a script overrides an imported strategy's knobs by
    /// defining them itself.
    main: String,
    imports: Vec<String>,
}

impl Consts {
    fn get(&self, file: &str, name: &str) -> Option<Dynamic> {
        if let Some(v) = self.by_file.get(file).and_then(|t| t.get(name)) {
            return Some(v.clone());
        }
        if file != self.main {
            return None;
        }
        self.imports
            .iter()
            .rev()
            .find_map(|f| self.by_file.get(f).and_then(|t| t.get(name)))
            .cloned()
    }
}

type ConstTable = Arc<RwLock<Consts>>;

/// Compile `source` and run its top-level statements once, recording its
/// constants. Rhai functions cannot read top-level variables; the engine's
/// variable resolver serves each file's constants (a strategy's knobs) to
/// the functions of that file, read-only.
fn compile_with_constants(
    engine: &Engine,
    consts: &ConstTable,
    file: &str,
    source: &str,
) -> Result<AST, ScriptError> {
    let parse_err = |e: rhai::ParseError| {
        ScriptError::new(file, e.position(), strip_position(&e.0.to_string()))
    };
    let mut ast = engine.compile(source).map_err(parse_err)?;
    ast.set_source(file);
    let mut scope = Scope::new();
    engine
        .run_ast_with_scope(&mut scope, &ast)
        .map_err(|e| ScriptError::from_eval(file, &e))?;
    let table: HashMap<String, Dynamic> = scope
        .iter()
        .filter(|(_, is_const, _)| *is_const)
        .map(|(name, _, value)| (name.to_string(), value))
        .collect();
    consts
        .write()
        .expect("constants lock")
        .by_file
        .insert(file.to_string(), table);
    Ok(ast)
}

/// A compiled script version: its source, the sources of every file it
/// imports, a content hash over all of them, and its own engine (holding
/// the script as a global module, so functions see their imports).
#[derive(Clone)]
pub struct Script {
    pub path: PathBuf,
    pub source: String,
    /// Imported files (path, source), in first-import order.
    pub imports: Vec<(PathBuf, String)>,
    pub hash: String,
    engine: Arc<Engine>,
    fns: Vec<(String, usize)>,
    empty: AST,
    budget: Arc<Mutex<CallBudget>>,
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
    /// Read and compile a script file. Imports resolve against the file's
    /// directory (`scripts/guidance.rhai` imports `"guidance/gaussian"`).
    pub fn load(handles: &ScriptHandles, path: &Path) -> Result<Self, ScriptError> {
        let source = std::fs::read_to_string(path).map_err(|e| ScriptError {
            file: path.display().to_string(),
            line: 0,
            col: 0,
            msg: format!("cannot read script: {e}"),
        })?;
        Script::compile(handles, path, source)
    }

    /// Compile source text; runs the top-level statements (constants,
    /// imports) once.
    pub fn compile(
        handles: &ScriptHandles,
        path: &Path,
        source: String,
    ) -> Result<Self, ScriptError> {
        let file = path.display().to_string();
        let root = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."))
            .to_path_buf();
        let log = Arc::new(Mutex::new(ImportLog::default()));
        let consts = ConstTable::default();
        let mut engine = engine_with(
            handles,
            Some(ImportResolver {
                root: root.clone(),
                log: log.clone(),
                consts: consts.clone(),
            }),
        );
        let import_error = |e: ScriptError| -> ScriptError {
            log.lock().expect("import log").error.take().unwrap_or(e)
        };
        consts.write().expect("constants lock").main = file.clone();
        let main_ast =
            compile_with_constants(&engine, &consts, &file, &source).map_err(import_error)?;
        // `import "guidance/gaussian";` makes the imported file's functions
        // this script's own (the script's definitions win), so a one-line
        // script is a bundled strategy; namespaced calls (`g::plan(..)`)
        // work as well.
        let mut ast = AST::empty();
        {
            let mut log = log.lock().expect("import log");
            let mut c = consts.write().expect("constants lock");
            for (f, a) in &log.asts {
                ast = ast.merge(a);
                c.imports.push(f.clone());
            }
            log.asts.clear();
        }
        let mut ast = ast.merge(&main_ast);
        ast.set_source(file.as_str());
        let fns: Vec<(String, usize)> = ast
            .iter_functions()
            .map(|f| (f.name.to_string(), f.params.len()))
            .collect();
        // As a module, every function carries the script's imports with it,
        // so `g::plan(..)` works when entry points are called one by one.
        let module = rhai::Module::eval_ast_as_new(Scope::new(), &ast, &engine)
            .map_err(|e| import_error(ScriptError::from_eval(&file, &e)))?;
        engine.register_global_module(module.into());
        let imports = std::mem::take(&mut log.lock().expect("import log").files);
        // The hash covers the sources and the imports' paths relative to
        // the script, so the run directory's copy (same layout, another
        // place) has the same version hash.
        let mut all = source.clone();
        for (p, s) in &imports {
            let rel = p.strip_prefix(&root).unwrap_or(p);
            all.push_str(&format!("\n// {}\n{s}", rel.display()));
        }
        let empty = engine
            .compile("")
            .map_err(|e| ScriptError::new(&file, e.position(), e.to_string()))?;
        Ok(Script {
            path: path.to_path_buf(),
            hash: content_hash(&all),
            source,
            imports,
            engine: Arc::new(engine),
            fns,
            empty,
            budget: handles.budget.clone(),
        })
    }

    pub fn file(&self) -> String {
        self.path.display().to_string()
    }

    /// Does the script define `name` with `arity` parameters?
    pub fn has_fn(&self, name: &str, arity: usize) -> bool {
        self.fns.iter().any(|(n, a)| n == name && *a == arity)
    }

    /// Call an entry point without re-running top-level statements.
    pub fn call(&self, name: &str, args: impl rhai::FuncArgs) -> Result<Dynamic, ScriptError> {
        let opts = CallFnOptions::new()
            .eval_ast(false)
            .rewind_scope(true)
            .in_all_namespaces(true);
        {
            let mut b = self.budget.lock().expect("budget lock");
            b.deadline = Some(std::time::Instant::now() + b.limit);
        }
        let out = self.engine.call_fn_with_options::<Dynamic>(
            opts,
            &mut Scope::new(),
            &self.empty,
            name,
            args,
        );
        self.budget.lock().expect("budget lock").deadline = None;
        out.map_err(|e| {
            let e = ScriptError::from_eval(&self.file(), &e);
            if e.line > 0 {
                return e;
            }
            // No position (e.g. the operation limit): point at the
            // entry point's definition.
            let mut at = self.fn_position(name);
            at.msg = format!("in fn {name}: {}", e.msg);
            at
        })
    }

    /// Where `fn name(` is defined: in the script, else in its imports
    /// (line 0 if not found).
    pub fn fn_position(&self, name: &str) -> ScriptError {
        let files = std::iter::once((self.path.clone(), &self.source))
            .chain(self.imports.iter().map(|(p, s)| (p.clone(), s)));
        for (path, src) in files {
            for (i, line) in src.lines().enumerate() {
                let t = line.trim_start();
                if let Some(rest) = t.strip_prefix("fn ") {
                    if rest.trim_start().starts_with(name)
                        && rest.trim_start()[name.len()..]
                            .trim_start()
                            .starts_with('(')
                    {
                        return ScriptError {
                            file: path.display().to_string(),
                            line: i + 1,
                            col: line.len() - t.len() + 1,
                            msg: String::new(),
                        };
                    }
                }
            }
        }
        ScriptError {
            file: self.file(),
            line: 0,
            col: 0,
            msg: String::new(),
        }
    }
}

/// Convert a serde value into a Rhai value (task and batch views).
pub fn to_dynamic<T: serde::Serialize>(v: &T) -> Dynamic {
    rhai::serde::to_dynamic(v).unwrap_or(Dynamic::UNIT)
}

#[cfg(test)]
mod effects_tests {
    use super::*;

    #[test]
    fn metrics_and_logs_are_capped_per_step() {
        let handles = ScriptHandles::new();
        let engine = super::engine(&handles);
        engine
            .run(r#"for i in 0..5000 { metric("m" + i, i); log("line " + i); } let n = "x"; n.pad(5000, "x"); metric(n, 1.0);"#)
            .unwrap();
        let e = handles.take_effects();
        assert_eq!(e.metrics.len(), MAX_METRICS_PER_STEP);
        assert_eq!(e.dropped_metrics, 5001 - MAX_METRICS_PER_STEP);
        assert_eq!(e.logs.len(), MAX_LOGS_PER_STEP);
        assert_eq!(e.dropped_logs, 5000 - MAX_LOGS_PER_STEP);
        // The next step starts from empty buffers.
        assert_eq!(handles.take_effects().metrics.len(), 0);
        let handles = ScriptHandles::new();
        let engine = super::engine(&handles);
        engine
            .run(r#"let s = ""; s.pad(5000, "y"); log(s); metric(s, 2);"#)
            .unwrap();
        let e = handles.take_effects();
        assert_eq!(e.logs[0].chars().count(), MAX_EFFECT_CHARS);
        assert_eq!(e.metrics[0].0.chars().count(), MAX_EFFECT_CHARS);
    }
}

#[cfg(test)]
mod budget_tests {
    use super::*;

    #[test]
    fn a_call_over_its_wall_clock_budget_is_a_positioned_error() {
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("slow.rhai");
        std::fs::write(
            &path,
            "fn slow(n) { let x = 0; while x < n { x += 1; } x }\nfn fast() { 1 }\n",
        )
        .unwrap();
        let handles = ScriptHandles::new();
        let script = Script::load(&handles, &path).unwrap();
        // Under the operation limit, over a 1 ms budget.
        handles.set_call_budget(std::time::Duration::from_millis(1));
        let e = script.call("slow", (100_000 as rhai::INT,)).unwrap_err();
        assert!(e.msg.contains("wall-clock budget of 0.001 s"), "{e}");
        assert!(e.to_string().contains("slow.rhai:"), "{e}");
        // The next call gets a fresh deadline.
        assert_eq!(script.call("fast", ()).unwrap().as_int().unwrap(), 1);
        handles.set_call_budget(std::time::Duration::from_secs(60));
        let n = script.call("slow", (100_000 as rhai::INT,)).unwrap();
        assert_eq!(n.as_int().unwrap(), 100_000);
    }
}
