//! Each fused kernel against its composite candle version, forward and
//! backward.

use super::*;
use candle_core::{Device, Tensor, Var, D};
use rand::{Rng, SeedableRng};

fn randn(rng: &mut rand_chacha::ChaCha8Rng, shape: &[usize]) -> Var {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
    Var::from_tensor(&Tensor::from_vec(v, shape, &Device::Cpu).unwrap()).unwrap()
}

#[test]
fn frozen_linear_matches_matmul_without_a_weight_gradient() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    let x = randn(&mut rng, &[7, 5]);
    let w = randn(&mut rng, &[4, 5]);
    let up = randn(&mut rng, &[4, 3]);
    // Something downstream, so the incoming gradient is not all ones.
    let y1 = frozen_linear(x.as_tensor(), w.as_tensor())
        .unwrap()
        .matmul(up.as_tensor())
        .unwrap();
    let y2 = x
        .as_tensor()
        .matmul(&w.as_tensor().t().unwrap())
        .unwrap()
        .matmul(up.as_tensor())
        .unwrap();
    assert!(max_diff(&y1, &y2) < 1e-5);
    let g1 = y1.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let g2 = y2.sqr().unwrap().sum_all().unwrap().backward().unwrap();
    let (a, b) = (
        g1.get(x.as_tensor()).unwrap(),
        g2.get(x.as_tensor()).unwrap(),
    );
    assert!(max_diff(a, b) < 1e-4, "dx differs by {}", max_diff(a, b));
    assert!(
        g1.get(w.as_tensor()).is_none(),
        "the frozen weight got a gradient"
    );
    assert!(g2.get(w.as_tensor()).is_some());
}

/// `sum((y @ up)²)`: a loss whose gradient into `y` is not all ones.
fn sq_loss(y: &Tensor, up: &Var) -> Tensor {
    y.matmul(up.as_tensor())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
}

/// `got` within `rel` of `want`, relative to `want`'s largest |value|
/// (which must be non-zero: a vanished gradient fails).
fn assert_grad_close(got: &Tensor, want: &Tensor, rel: f32, what: &str) {
    let scale = max_abs(want);
    assert!(scale > 0.0, "{what}: zero gradient");
    let d = max_diff(got, want);
    assert!(d < rel * scale, "{what} differs by {d} (scale {scale})");
}

/// The loaded BLAS, or `None` after printing why the calling test skips.
fn blas_or_skip() -> Option<&'static blas::Blas> {
    let b = blas::blas();
    if b.is_none() {
        println!("SKIPPED: no BLAS found (scripts/install-mkl.sh, or ACTGUIDE_BLAS)");
    }
    b
}

/// The run-time BLAS product against candle's matmul, forward and both
/// gradients, at shapes that take the serial call, the row split and the
/// column split (n not a multiple of the 16-column blocks).
#[test]
fn blas_linear_matches_matmul_forward_and_backward() {
    let Some(b) = blas_or_skip() else { return };
    println!("BLAS: {}", b.name);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
    for (m, k, n) in [(7, 5, 4), (200, 96, 128), (4, 1024, 300), (3, 700, 1000)] {
        let x = randn(&mut rng, &[m, k]);
        let w = randn(&mut rng, &[n, k]);
        let up = randn(&mut rng, &[n, 3]);
        let y1 = linear(x.as_tensor(), w.as_tensor()).unwrap();
        let y2 = x.as_tensor().matmul(&w.as_tensor().t().unwrap()).unwrap();
        let tol = 1e-5 * k as f32;
        assert!(
            max_diff(&y1, &y2) < tol,
            "{m}x{k}x{n}: y differs by {}",
            max_diff(&y1, &y2)
        );
        let loss = |y: &Tensor| sq_loss(y, &up);
        let (g1, g2) = (loss(&y1).backward().unwrap(), loss(&y2).backward().unwrap());
        let rel = 1e-5 * k.max(n) as f32;
        for (what, v) in [("dx", &x), ("dw", &w)] {
            let (a, b) = (
                g1.get(v.as_tensor()).unwrap(),
                g2.get(v.as_tensor()).unwrap(),
            );
            assert_grad_close(a, b, rel, &format!("{m}x{k}x{n}: {what}"));
        }
        // A frozen weight: the BLAS op computes dx only.
        let g = loss(&frozen_linear(x.as_tensor(), w.as_tensor()).unwrap())
            .backward()
            .unwrap();
        assert!(
            g.get(w.as_tensor()).is_none(),
            "the frozen weight got a gradient"
        );
        let (a, b) = (
            g.get(x.as_tensor()).unwrap(),
            g2.get(x.as_tensor()).unwrap(),
        );
        assert_grad_close(a, b, rel, &format!("{m}x{k}x{n}: frozen dx"));
    }
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    max_abs(&(a - b).unwrap())
}

/// The largest |element| of `t`.
fn max_abs(t: &Tensor) -> f32 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Composite reference: mask, scale, softmax with candle's slow ops.
fn ref_softmax(x: &Tensor, scale: f64, q_len: usize) -> Tensor {
    let s = x.dim(D::Minus1).unwrap();
    let mut mask = vec![0f32; q_len * s];
    for i in 0..q_len {
        for j in (i + s - q_len + 1)..s {
            mask[i * s + j] = f32::NEG_INFINITY;
        }
    }
    let mask = Tensor::from_vec(mask, (q_len, s), x.device()).unwrap();
    let shape = x.shape().clone();
    let x = x
        .reshape((x.elem_count() / (q_len * s), q_len, s))
        .unwrap()
        .affine(scale, 0.0)
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    candle_nn::ops::softmax(&x, D::Minus1)
        .unwrap()
        .reshape(shape)
        .unwrap()
}

#[test]
fn causal_softmax_matches_composite_forward_and_backward() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(0);
    // Small (sequential) and large (threaded) cases; s > q_len = decode-like.
    for (shape, q_len) in [
        (vec![2, 3, 5, 5], 5),
        (vec![2, 2, 3, 7], 3),
        // GQA layout: rows are (kv head, rep, query), q_len divides them.
        (vec![2, 2, 6, 5], 3),
        (vec![4, 2, 2, 96, 96], 96),
    ] {
        let x = randn(&mut rng, &shape);
        let wt = randn(&mut rng, &shape);
        let a = causal_softmax(x.as_tensor(), 0.7, q_len).unwrap();
        let b = ref_softmax(x.as_tensor(), 0.7, q_len);
        assert!(max_diff(&a, &b) < 1e-6, "forward {shape:?}");
        let la = (a * wt.as_tensor()).unwrap().sum_all().unwrap();
        let lb = (b * wt.as_tensor()).unwrap().sum_all().unwrap();
        let ga = la.backward().unwrap();
        let gb = lb.backward().unwrap();
        let (ga, gb) = (ga.get(&x).unwrap(), gb.get(&x).unwrap());
        assert!(max_diff(ga, gb) < 1e-5, "backward {shape:?}");
    }
}

#[test]
fn rms_norm_matches_composite_forward_and_backward() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(1);
    // Hidden sizes of whole and partial 64-column blocks of `dw`.
    for (rows, h) in [(3usize, 128usize), (700, 128), (700, 200)] {
        let x = randn(&mut rng, &[rows, h]);
        let w = randn(&mut rng, &[h]);
        let wt = randn(&mut rng, &[rows, h]);
        let a = rms_norm(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        let b = candle_nn::ops::rms_norm_slow(x.as_tensor(), w.as_tensor(), 1e-5).unwrap();
        assert!(max_diff(&a, &b) < 1e-5, "forward");
        let ga = (a * wt.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        let gb = (b * wt.as_tensor())
            .unwrap()
            .sum_all()
            .unwrap()
            .backward()
            .unwrap();
        assert!(
            max_diff(ga.get(&x).unwrap(), gb.get(&x).unwrap()) < 1e-4,
            "dx"
        );
        let (dwa, dwb) = (ga.get(&w).unwrap(), gb.get(&w).unwrap());
        let rel = max_diff(dwa, dwb)
            / dwb
                .abs()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
        assert!(rel < 1e-4, "dw rel {rel}");
    }
}

fn grads_match(fused: &Tensor, composite: &Tensor, x: &Var, weight: &Var, what: &str) {
    assert!(max_diff(fused, composite) < 1e-5, "{what} forward");
    let ga = (fused * weight.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let gb = (composite * weight.as_tensor())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let d = max_diff(ga.get(x).unwrap(), gb.get(x).unwrap());
    assert!(d < 1e-5, "{what} backward: {d}");
}

#[test]
fn rope_matches_composite() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(2);
    let inv_freq: Vec<f32> = (0..8)
        .map(|i| 1.0 / 10000f32.powf(2.0 * i as f32 / 16.0))
        .collect();
    // Shared positions (scoring), per-sequence positions (generation),
    // and a large case that goes through the threaded path.
    for (b, t, h, rows) in [(2, 5, 3, 1), (3, 4, 2, 3), (8, 64, 4, 8)] {
        let pos: Vec<usize> = (0..rows * t).map(|i| (i * 7) % 50).collect();
        let tables = RopeTables::new(&inv_freq, &pos, rows, t);
        let x = randn(&mut rng, &[b, t, h, 16]);
        let wt = randn(&mut rng, &[b, h, t, 16]);
        let a = rope_heads_first(x.as_tensor(), &tables).unwrap();
        let c = rope_heads_first_composite(x.as_tensor(), &tables).unwrap();
        assert_eq!(a.dims(), &[b, h, t, 16]);
        grads_match(&a, &c, &x, &wt, "rope");
    }
}

#[test]
fn swiglu_matches_composite() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(3);
    for rows in [3usize, 500] {
        let x = randn(&mut rng, &[rows, 2 * 96]);
        let wt = randn(&mut rng, &[rows, 96]);
        let a = swiglu(x.as_tensor()).unwrap();
        let c = swiglu_composite(x.as_tensor()).unwrap();
        grads_match(&a, &c, &x, &wt, "swiglu");
    }
}

#[test]
fn logp_entropy_matches_composite() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(4);
    for (n, v, scale) in [(5usize, 11usize, 1.0), (7, 50, 1.0 / 0.7), (300, 400, 0.8)] {
        let x = randn(&mut rng, &[n, v]);
        let targets: Vec<u32> = (0..n).map(|_| rng.random_range(0..v as u32)).collect();
        let wt = randn(&mut rng, &[n, 2]);
        let a = logp_entropy(x.as_tensor(), &targets, scale).unwrap();
        let c = logp_entropy_composite(x.as_tensor(), &targets, scale).unwrap();
        grads_match(&a, &c, &x, &wt, "logp-entropy");
    }
}

/// The batched BLAS product against candle's matmul, forward and both
/// gradients, for `a b` and `a bᵀ`, with `b` a narrowed view (as the KV
/// cache hands it over) and a batch of (b, heads) dimensions.
#[test]
fn bmm_matches_matmul_forward_and_backward() {
    if blas_or_skip().is_none() {
        return;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    for tb in [false, true] {
        let a = randn(&mut rng, &[2, 3, 5, 4]);
        // b: (2, 3, 4, 6) (or (2, 3, 6, 4) for bᵀ), narrowed out of a
        // wider buffer along the row axis.
        let (rows, cols) = if tb { (6, 4) } else { (4, 6) };
        let big = randn(&mut rng, &[2, 3, rows + 3, cols]);
        let b = big.as_tensor().narrow(2, 1, rows).unwrap();
        let up = randn(&mut rng, &[2, 3, 6, 2]);
        let y1 = bmm(a.as_tensor(), &b, tb).unwrap();
        let bt = if tb { b.t().unwrap() } else { b.clone() };
        let y2 = a.as_tensor().matmul(&bt).unwrap();
        assert_eq!(y1.dims(), &[2, 3, 5, 6]);
        assert!(
            max_diff(&y1, &y2) < 1e-4,
            "tb {tb}: y differs by {}",
            max_diff(&y1, &y2)
        );
        let loss = |y: &Tensor| sq_loss(y, &up);
        let (g1, g2) = (loss(&y1).backward().unwrap(), loss(&y2).backward().unwrap());
        for (what, v) in [("da", &a), ("db", &big)] {
            let (x, y) = (
                g1.get(v.as_tensor()).unwrap(),
                g2.get(v.as_tensor()).unwrap(),
            );
            assert_grad_close(x, y, 1e-4, &format!("tb {tb}: {what}"));
        }
    }
}

/// Reference attention with candle's differentiable ops: `softmax(q kᵀ ·
/// scale + mask) v` per (batch, kv head), with the fused op's visibility
/// rule (row `rr` is query position `rr % t`).
fn ref_attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    scale: f64,
    t: usize,
    vis: Visible<'_>,
) -> Tensor {
    let (b, nkv, rq, _) = q.dims4().unwrap();
    let s = k.dim(2).unwrap();
    let mut mask = vec![f32::NEG_INFINITY; b * rq * s];
    for bi in 0..b {
        for rr in 0..rq {
            let hi = rr % t + s - t;
            for c in 0..=hi {
                let seen = match vis {
                    Visible::Causal => true,
                    Visible::Pads(p) => c >= p[bi].min(hi),
                    Visible::Tree(reach) => hi < reach[bi * s + c],
                };
                if seen {
                    mask[(bi * rq + rr) * s + c] = 0.0;
                }
            }
        }
    }
    let mask = Tensor::from_vec(mask, (b, 1, rq, s), &Device::Cpu).unwrap();
    let scores = (q.matmul(&k.t().unwrap()).unwrap() * scale)
        .unwrap()
        .broadcast_add(&mask)
        .unwrap();
    let _ = nkv;
    candle_nn::ops::softmax(&scores, D::Minus1)
        .unwrap()
        .matmul(&v.contiguous().unwrap())
        .unwrap()
}

/// Fused attention against the composite reference, forward and the
/// gradients of q, k and v: causal over several row blocks (a block
/// straddling two query heads), and left-padded prefill and decode shapes
/// reading k and v as narrowed views of a cache, and packed prefix trees
/// (whose blocks gather the columns they see).
#[test]
fn fused_attention_matches_composite_forward_and_backward() {
    if blas_or_skip().is_none() {
        return;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(21);
    // Prefix trees: random sequences over a 2-token alphabet share a lot.
    let mut tree = |n: usize, len: usize| -> Vec<usize> {
        let seqs: Vec<Vec<u32>> = (0..n)
            .map(|_| (0..len).map(|_| rng.random_range(0..2u32)).collect())
            .collect();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let (order, _) = crate::model::llama::pack::plan(&refs, usize::MAX);
        let sorted: Vec<&[u32]> = order.iter().map(|&i| refs[i]).collect();
        crate::model::llama::pack::pack(&sorted).reach
    };
    let (tree1, tree2) = (tree(12, 14), tree(3, 4));
    // (b, n_kv, rep, t, s, hd, mask, cache columns before/after)
    type Case = (usize, usize, usize, usize, usize, usize, Mask, usize);
    enum Mask {
        Causal,
        Pads(Vec<usize>),
        Tree(Vec<usize>),
    }
    let (t1, t2) = (tree1.len(), tree2.len());
    let cases: Vec<Case> = vec![
        (2, 2, 2, 70, 70, 8, Mask::Causal, 0),
        (1, 1, 3, 5, 5, 4, Mask::Causal, 0),
        (2, 2, 2, 6, 6, 8, Mask::Pads(vec![0, 3]), 2),
        (3, 1, 4, 1, 9, 8, Mask::Pads(vec![0, 4, 8]), 3),
        (1, 2, 3, t1, t1, 8, Mask::Tree(tree1.clone()), 0),
        (1, 1, 1, t2, t2, 4, Mask::Tree(tree2.clone()), 0),
    ];
    assert!(
        t1 > 64 && t1 < 12 * 14,
        "a shared, multi-block tree ({t1} tokens)"
    );
    for (b, nkv, rep, t, s, hd, mask, extra) in cases {
        let vis = match &mask {
            Mask::Causal => Visible::Causal,
            Mask::Pads(p) => Visible::Pads(p),
            Mask::Tree(r) => Visible::Tree(r),
        };
        let what = format!("b{b} kv{nkv} rep{rep} t{t} s{s} {vis:?}");
        let q = randn(&mut rng, &[b, nkv, rep * t, hd]);
        let kbig = randn(&mut rng, &[b, nkv, s + 2 * extra, hd]);
        let vbig = randn(&mut rng, &[b, nkv, s + 2 * extra, hd]);
        let k = kbig.as_tensor().narrow(2, extra, s).unwrap();
        let v = vbig.as_tensor().narrow(2, extra, s).unwrap();
        let up = randn(&mut rng, &[hd, 3]);
        let scale = 1.0 / (hd as f64).sqrt();
        let y1 = attention(q.as_tensor(), &k, &v, scale, t, vis)
            .unwrap()
            .expect("the fused path applies");
        let y2 = ref_attention(q.as_tensor(), &k, &v, scale, t, vis);
        assert_eq!(y1.dims(), y2.dims());
        let d = max_diff(&y1, &y2);
        assert!(d < 1e-5, "{what}: y differs by {d}");
        let loss = |y: &Tensor| {
            let y = y.broadcast_matmul(up.as_tensor()).unwrap();
            y.sqr().unwrap().sum_all().unwrap()
        };
        let (g1, g2) = (loss(&y1).backward().unwrap(), loss(&y2).backward().unwrap());
        for (name, var) in [("dq", &q), ("dk", &kbig), ("dv", &vbig)] {
            let (a, b) = (
                g1.get(var.as_tensor()).expect("fused gradient"),
                g2.get(var.as_tensor()).unwrap(),
            );
            assert_grad_close(a, b, 1e-4, &format!("{what}: {name}"));
        }
    }
}

/// f32 products with a packed weight (the decode kernel) against the
/// unpacked product, at widths and depths off the kernel's blocks and row
/// counts over its tiles; tracked inputs (training) keep the unpacked path;
/// dropping the packs unregisters them.
#[test]
fn packed_f32_weights_match_unpacked_products() {
    if !f32_rollout_packs() {
        println!("SKIPPED: this CPU has no AVX-512 or AVX2 (or MKL on an Intel AVX-512 CPU keeps decode)");
        return;
    }
    // Pack these small weights (below the size generation packs).
    PACK_MIN_ELEMS_OVERRIDE.with(|c| c.set(Some(0)));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(34);
    for (n, k) in [(100, 64), (577, 97)] {
        let w = randn(&mut rng, &[n, k]).as_tensor().detach();
        for m in [1, 5, 64, 200] {
            let x = randn(&mut rng, &[m, k]);
            let plain = linear(&x.as_tensor().detach(), &w).unwrap();
            let packed = PackedWeights::pack_f32(&[&w], None)
                .unwrap()
                .expect("f32 packs where f32_rollout_packs holds");
            assert!(packed.bytes >= 4 * n * k && is_packed(w.id()));
            let before = PACKED_PRODUCTS.with(|c| c.get());
            let y = linear(&x.as_tensor().detach(), &w).unwrap();
            let used = PACKED_PRODUCTS.with(|c| c.get()) > before;
            // The AVX2 kernel takes decode-sized products (≤ 64 rows) only.
            let avx2 = super::skinny::isa() == Some(super::skinny::Isa::Avx2);
            assert_eq!(
                used,
                m <= 64 || !avx2,
                "{m} rows: packed weight used: {used}"
            );
            let d = max_diff(&y, &plain);
            assert!(d < 1e-5 * k as f32, "{m}x{k}x{n}: packed differs by {d}");
            // A tracked input is a training product: never the packed path.
            let before = PACKED_PRODUCTS.with(|c| c.get());
            let yt = linear(x.as_tensor(), &w).unwrap();
            assert_eq!(PACKED_PRODUCTS.with(|c| c.get()), before);
            assert!(max_diff(&yt, &plain) < 1e-5 * k as f32);
            drop(packed);
            assert!(!is_packed(w.id()), "dropped packs stay registered");
        }
    }
}

/// bf16 products with an MKL-packed weight (decode-sized batches) against
/// the unpacked bf16 product, at widths that are not multiples of the
/// 16-column blocks; dropping the packed copies unregisters them.
#[test]
fn packed_bf16_weights_match_unpacked_products() {
    if !bf16_rollouts_available() {
        println!("SKIPPED: no BLAS with bf16 products (scripts/install-mkl.sh)");
        return;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(33);
    for (n, k) in [(100, 64), (577, 96)] {
        let w = randn(&mut rng, &[n, k])
            .as_tensor()
            .to_dtype(candle_core::DType::BF16)
            .unwrap();
        for m in [1, 5, 64, 65] {
            let x = randn(&mut rng, &[m, k]);
            let plain = linear(x.as_tensor(), &w).unwrap();
            let packed = PackedWeights::pack(&[&w], None)
                .unwrap()
                .expect("MKL has the packing API");
            assert!(packed.bytes >= 2 * n * k && is_packed(w.id()));
            let before = PACKED_PRODUCTS.with(|c| c.get());
            let y = linear(x.as_tensor(), &w).unwrap();
            let used = PACKED_PRODUCTS.with(|c| c.get()) > before;
            assert_eq!(used, m <= 64, "{m} rows: packed weight used: {used}");
            let d = max_diff(&y, &plain);
            assert!(d < 1e-4 * k as f32, "{m}x{k}x{n}: packed differs by {d}");
            drop(packed);
            assert!(!is_packed(w.id()), "dropped packs stay registered");
        }
    }
}

/// A test kernel: `2x`, with no backward.
struct Double;

impl Kernel1 for Double {
    const NAME: &'static str = "test-double";

    fn forward(&self, x: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        Ok((x.data.iter().map(|v| 2.0 * v).collect(), x.shape.clone()))
    }
}

/// A test kernel: `a + b` of equal shapes, with no backward.
struct Add;

impl Kernel2 for Add {
    const NAME: &'static str = "test-add";

    fn forward(&self, a: Input<'_>, b: Input<'_>) -> candle_core::Result<(Vec<f32>, Shape)> {
        let sum = a.data.iter().zip(b.data).map(|(x, y)| x + y).collect();
        Ok((sum, a.shape.clone()))
    }
}

#[test]
fn the_kernel_adapters_run_contiguous_f32_and_refuse_the_rest_by_op_name() {
    let x = Tensor::arange(0f32, 6.0, &Device::Cpu)
        .unwrap()
        .reshape((2, 3))
        .unwrap();
    let y = x.apply_op1_no_bwd(&Fused1(Double)).unwrap();
    assert_eq!(y.dims(), &[2, 3]);
    assert_eq!(
        y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]
    );
    let s = x.apply_op2_no_bwd(&y, &Fused2(Add)).unwrap();
    assert_eq!(
        s.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        [0.0, 3.0, 6.0, 9.0, 12.0, 15.0]
    );
    let err = |r: candle_core::Result<Tensor>| r.unwrap_err().to_string();
    let bf16 = x.to_dtype(DType::BF16).unwrap();
    let e = err(bf16.apply_op1_no_bwd(&Fused1(Double)));
    assert!(e.contains("test-double: only f32 is supported"), "{e}");
    let strided = x.t().unwrap();
    let e = err(strided.apply_op1_no_bwd(&Fused1(Double)));
    assert!(e.contains("test-double: input must be contiguous"), "{e}");
    // Either input of a two-input kernel is checked.
    let e = err(x.apply_op2_no_bwd(&bf16, &Fused2(Add)));
    assert!(e.contains("test-add: only f32 is supported"), "{e}");
    let xt = x.t().unwrap().contiguous().unwrap();
    let e = err(xt.apply_op2_no_bwd(&strided, &Fused2(Add)));
    assert!(e.contains("test-add: input must be contiguous"), "{e}");
}

#[test]
fn a_kernel_without_a_backward_names_itself_when_differentiated() {
    let x = Var::from_tensor(&Tensor::ones((2, 3), DType::F32, &Device::Cpu).unwrap()).unwrap();
    let y = x.as_tensor().apply_op1(Fused1(Double)).unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("test-double"), "{e}");
    let y = x.as_tensor().apply_op2(x.as_tensor(), Fused2(Add)).unwrap();
    let e = y.sum_all().unwrap().backward().unwrap_err().to_string();
    assert!(e.contains("test-add"), "{e}");
}

/// The vendored candle sums a tensor's gradients in place where the stored
/// sum shares its storage with no other tensor, and index-adds an
/// embedding's rows into it in place: the sums must be exactly those of
/// fresh tensors, and a gradient that is a view of another's storage (or
/// the same tensor stored for two operands) must never be written through.
#[test]
fn in_place_gradient_sums_are_exact_and_never_alias() {
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let vals = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    // One gradient stored for both operands of `x + x`, then more terms.
    let x = randn(&mut rng, &[3, 4]);
    let k = randn(&mut rng, &[3, 4]);
    let xt = x.as_tensor();
    let y = ((xt + xt).unwrap() * k.as_tensor()).unwrap();
    let y = (y + (xt * 3.0).unwrap()).unwrap();
    let y = (y + xt.sqr().unwrap()).unwrap().sum_all().unwrap();
    let g = y.backward().unwrap();
    let expect: Vec<f32> = vals(xt)
        .iter()
        .zip(vals(k.as_tensor()))
        .map(|(&x, k)| 2.0 * k + 3.0 + 2.0 * x)
        .collect();
    let got = vals(g.get(xt).unwrap());
    for (a, b) in got.iter().zip(&expect) {
        assert!((a - b).abs() < 1e-5, "x + x: {a} vs {b}");
    }
    // Views: `cat` hands `a` and `b` row views of one gradient; a second
    // term on `a` must not write into `b`'s.
    let a = randn(&mut rng, &[2, 4]);
    let b = randn(&mut rng, &[3, 4]);
    let kc = randn(&mut rng, &[5, 4]);
    let s = Tensor::cat(&[a.as_tensor(), b.as_tensor()], 0).unwrap();
    let l = (s * kc.as_tensor()).unwrap().sum_all().unwrap();
    let l = (l + (a.as_tensor() * 3.0).unwrap().sum_all().unwrap()).unwrap();
    let l = (l + (b.as_tensor() * 5.0).unwrap().sum_all().unwrap()).unwrap();
    let g = l.backward().unwrap();
    let kv = vals(kc.as_tensor());
    let ga = vals(g.get(a.as_tensor()).unwrap());
    let gb = vals(g.get(b.as_tensor()).unwrap());
    for (i, v) in ga.iter().enumerate() {
        assert_eq!(*v, kv[i] + 3.0, "a[{i}]");
    }
    for (i, v) in gb.iter().enumerate() {
        assert_eq!(*v, kv[8 + i] + 5.0, "b[{i}]");
    }
    // A tied table: rows gathered (one id twice) and the table multiplied;
    // the same sums as two untied copies of it, bit for bit.
    let w = randn(&mut rng, &[6, 4]);
    let h = randn(&mut rng, &[5, 4]);
    let ids = Tensor::new(&[4u32, 1, 4], &Device::Cpu).unwrap();
    let tied = |e: &Tensor, head: &Tensor| {
        let rows = e
            .index_select(&ids, 0)
            .unwrap()
            .sqr()
            .unwrap()
            .sum_all()
            .unwrap();
        let logits = h.as_tensor().matmul(&head.t().unwrap()).unwrap();
        (rows + logits.sqr().unwrap().sum_all().unwrap()).unwrap()
    };
    let g = tied(w.as_tensor(), w.as_tensor()).backward().unwrap();
    let copy = || {
        let t = Tensor::from_vec(vals(w.as_tensor()), (6, 4), &Device::Cpu).unwrap();
        Var::from_tensor(&t).unwrap()
    };
    let (e2, h2) = (copy(), copy());
    let g2 = tied(e2.as_tensor(), h2.as_tensor()).backward().unwrap();
    let sum = (g2.get(e2.as_tensor()).unwrap() + g2.get(h2.as_tensor()).unwrap()).unwrap();
    let (t, u) = (vals(g.get(w.as_tensor()).unwrap()), vals(&sum));
    for (i, (p, q)) in t.iter().zip(&u).enumerate() {
        assert!(
            (p - q).abs() <= 1e-6 * q.abs().max(1.0),
            "tied table [{i}]: {p} vs {q}"
        );
    }
}
