//! The batched driver: every live episode advances one turn per step, with
//! one generation call over all of them.

use std::time::Instant;

use rand_chacha::ChaCha8Rng;

use crate::env::Env;
use crate::guidance::runtime::{Intervention, TurnView};
use rand::Rng;

use crate::inference::Request;
use crate::model::{GenerateOptions, Generated, ModelError, Policy, Tok, TokenTrie};

use super::encode::Fmt;
use super::episode::{Episode, EpisodeRequest, Live};
use super::{RolloutError, RolloutOptions};

/// Throughput counters of one `run` call.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RolloutStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    pub generate_calls: usize,
    pub seconds: f64,
}

/// Called before each policy turn of each live episode.
pub type InterveneFn<'f> = &'f mut dyn FnMut(&TurnView) -> Intervention;

/// Run all `requests` to completion. `make_env(limit)` builds a fresh env
/// per episode with that step limit (see [`RolloutOptions::env_limit`]).
/// Generation is one batch over every live episode per turn. `expert()`
/// requests replay the expert trajectory and record it as off-policy turns.
pub fn run(
    policy: &Policy,
    tok: &Tok,
    make_env: &dyn Fn(usize) -> Box<dyn Env>,
    requests: &[EpisodeRequest<'_>],
    opts: &RolloutOptions,
    rng: &mut ChaCha8Rng,
    mut intervene: Option<InterveneFn<'_>>,
) -> Result<(Vec<Episode>, RolloutStats), RolloutError> {
    let t0 = Instant::now();
    let fmt = Fmt::new(policy, tok, opts)?;
    let mut stats = RolloutStats::default();
    // Envs are made in order (the factory need not be thread-safe); their
    // resets and expert prefixes may overlap.
    let mut live: Vec<Live> = requests
        .iter()
        .map(|req| Live::with_env(req, make_env, opts))
        .collect();
    let begun = par_map(
        live.iter_mut().collect(),
        opts.env_concurrency,
        &|l: &mut Live| l.begin(&fmt, opts),
    );
    begun.into_iter().collect::<Result<Vec<()>, _>>()?;
    let gen_opts = GenerateOptions {
        max_new_tokens: opts.max_action_tokens,
        temperature: opts.temperature,
        top_p: opts.top_p,
        greedy: opts.greedy,
        eos_token_id: fmt.stop,
    };
    loop {
        // Interventions: a hint for this turn, or the end of the episode.
        let hints = match intervene.as_mut() {
            Some(f) => intervene_all(&mut live, &mut **f),
            None => vec![None; live.len()],
        };
        let idx: Vec<usize> = (0..live.len()).filter(|&i| !live[i].done).collect();
        if idx.is_empty() {
            break;
        }
        let batch = turn_batch(&live, &idx, &hints, &fmt, opts)?;
        stats.prompt_tokens += batch.prompts.iter().map(Vec::len).sum::<usize>();
        // With an engine, each answer's policy version too.
        let gens: Vec<Answer> = match &opts.engine {
            None => policy
                .generate(
                    &batch.prompts,
                    &gen_opts,
                    if opts.constrained {
                        Some(&batch.tries)
                    } else {
                        None
                    },
                    rng,
                )?
                .into_iter()
                .map(|g| (Ok(g), None))
                .collect(),
            Some(e) => engine_generate(e, &batch, &gen_opts, rng)?,
        };
        stats.generate_calls += 1;
        stats.generated_tokens += gens
            .iter()
            .filter_map(|(g, _)| g.as_ref().ok())
            .map(|g| g.tokens.len())
            .sum::<usize>();
        // The live episodes in `idx` order (idx lists the not-done ones).
        let turns = live
            .iter_mut()
            .filter(|l| !l.done)
            .zip(gens)
            .zip(batch.prompts.into_iter().zip(batch.unguided))
            .map(|((l, g), (p, u))| (l, g, p, u))
            .collect();
        let applied = par_map(turns, opts.env_concurrency, &|(l, (g, v), p, u)| {
            if let Some(v) = v {
                l.generated_at(v);
            }
            match g {
                Ok(g) => l.apply(g, p, u, &fmt, tok, opts),
                Err(why) => {
                    l.fail_engine(why);
                    Ok(())
                }
            }
        });
        applied.into_iter().collect::<Result<Vec<()>, _>>()?;
    }
    stats.seconds = t0.elapsed().as_secs_f64();
    Ok((live.into_iter().map(Live::finish).collect(), stats))
}

/// `f` over `items` on up to `threads` scoped threads (contiguous chunks),
/// results in input order; with one thread, in order on this one.
fn par_map<T: Send, R: Send>(items: Vec<T>, threads: usize, f: &(dyn Fn(T) -> R + Sync)) -> Vec<R> {
    if threads <= 1 || items.len() <= 1 {
        return items.into_iter().map(f).collect();
    }
    let per = items.len().div_ceil(threads);
    let mut chunks: Vec<Vec<T>> = Vec::new();
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(items.by_ref().take(per).collect());
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = chunks
            .into_iter()
            .map(|c| s.spawn(move || c.into_iter().map(f).collect::<Vec<R>>()))
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().expect("an env thread panicked"))
            .collect()
    })
}

/// Ask the intervention about every live episode, in order: the hint each
/// one shows this turn.
fn intervene_all(
    live: &mut [Live<'_>],
    f: &mut dyn FnMut(&TurnView) -> Intervention,
) -> Vec<Option<String>> {
    live.iter_mut()
        .map(|l| if l.done { None } else { l.intervene(f) })
        .collect()
}

/// One episode's generation of a turn (or why it failed), and the policy
/// version it came from (engines only).
type Answer = (Result<Generated, String>, Option<u64>);

/// The turn's generations on the engine: one request per live episode
/// (its prompt, its admissible answers when constrained, a seed from
/// `rng`); a failed request is that episode's failure.
fn engine_generate(
    e: &crate::inference::Engine,
    batch: &TurnBatch,
    o: &GenerateOptions,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<Answer>, RolloutError> {
    let model = e.model_name();
    let seeds: Vec<u64> = batch.prompts.iter().map(|_| rng.random()).collect();
    let reqs: Vec<Request<'_>> = batch
        .prompts
        .iter()
        .zip(&seeds)
        .enumerate()
        .map(|(i, (p, &seed))| Request {
            prompt: p,
            answers: batch.answers.get(i).map(Vec::as_slice),
            max_new_tokens: o.max_new_tokens,
            temperature: o.temperature,
            top_p: o.top_p,
            stop: o.eos_token_id,
            seed,
            model: &model,
        })
        .collect();
    let replies = e.pool().generate(&reqs).map_err(Box::new)?;
    Ok(replies
        .into_iter()
        .map(|r| match r {
            Ok(r) => (
                Ok(Generated {
                    tokens: r.tokens,
                    logprobs: r.logprobs,
                    finished: r.finished,
                }),
                Some(r.version),
            ),
            Err(why) => (Err(why), None),
        })
        .collect())
}

/// The generation inputs of one turn, one entry per live episode.
struct TurnBatch {
    /// The prompts generated under (plan or hint shown).
    prompts: Vec<Vec<u32>>,
    /// The same states without the guidance, where guided.
    unguided: Vec<Option<Vec<u32>>>,
    /// Admissible-action tries (constrained decoding only).
    tries: Vec<TokenTrie>,
    /// The admissible answers' texts (constrained decoding on an engine
    /// only).
    answers: Vec<Vec<String>>,
}

/// The generation inputs of this turn for the live episodes `idx`.
fn turn_batch(
    live: &[Live<'_>],
    idx: &[usize],
    hints: &[Option<String>],
    fmt: &Fmt<'_>,
    opts: &RolloutOptions,
) -> Result<TurnBatch, ModelError> {
    let mut b = TurnBatch {
        prompts: Vec::with_capacity(idx.len()),
        unguided: Vec::with_capacity(idx.len()),
        tries: Vec::with_capacity(idx.len()),
        answers: Vec::new(),
    };
    let on_engine = opts.engine.is_some();
    for &i in idx {
        let l = &live[i];
        let (guided, unguided) = l.turn_prompts(hints[i].as_ref(), fmt, opts)?;
        b.prompts.push(guided);
        b.unguided.push(unguided);
        if opts.constrained && on_engine {
            b.answers
                .push(l.admissible.iter().map(|a| fmt.answer_text(a)).collect());
        } else if opts.constrained {
            b.tries.push(l.action_trie(fmt)?);
        }
    }
    Ok(b)
}
