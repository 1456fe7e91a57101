//! An independent reference: a plain f64 host implementation of the HF
//! Llama forward, one sequence at a time, written without candle.

use super::*;

pub(super) struct HostModel {
    cfg: ModelConfig,
    w: HashMap<String, Vec<f64>>,
}

impl HostModel {
    pub(super) fn new(p: &Policy) -> Self {
        let w = p
            .named_tensors()
            .into_iter()
            .map(|(n, t)| {
                let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
                (n, v.into_iter().map(f64::from).collect())
            })
            .collect();
        HostModel {
            cfg: p.config().clone(),
            w,
        }
    }

    fn get(&self, n: &str) -> &[f64] {
        &self.w[n]
    }

    /// `W (out, in) @ x`.
    fn mv(w: &[f64], x: &[f64]) -> Vec<f64> {
        let inn = x.len();
        w.chunks(inn)
            .map(|row| row.iter().zip(x).map(|(a, b)| a * b).sum())
            .collect()
    }

    fn rms(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(w).map(|(a, b)| a * r * b).collect()
    }

    fn rope(v: &mut [f64], pos: usize, theta: f64) {
        let hd = v.len();
        let half = hd / 2;
        for i in 0..half {
            let f = 1.0 / theta.powf((2 * i) as f64 / hd as f64);
            let (s, c) = (pos as f64 * f).sin_cos();
            let (a, b) = (v[i], v[i + half]);
            v[i] = a * c - b * s;
            v[i + half] = b * c + a * s;
        }
    }

    /// Logits at every position of `seq`.
    pub(super) fn logits(&self, seq: &[u32]) -> Vec<Vec<f64>> {
        let c = &self.cfg;
        let (h, hd) = (c.hidden_size, c.head_dim());
        let (nh, nkv) = (c.num_attention_heads, c.num_key_value_heads);
        let rep = nh / nkv;
        let emb = self.get("model.embed_tokens.weight");
        let mut xs: Vec<Vec<f64>> = seq
            .iter()
            .map(|&t| emb[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let g = |n: &str| self.get(&format!("{p}.{n}"));
            let mut qs = Vec::new();
            let mut ks = Vec::new();
            let mut vs = Vec::new();
            for (t, x) in xs.iter().enumerate() {
                let hn = Self::rms(x, g("input_layernorm.weight"), c.rms_norm_eps);
                let mut q = Self::mv(g("self_attn.q_proj.weight"), &hn);
                let mut k = Self::mv(g("self_attn.k_proj.weight"), &hn);
                for hh in 0..nh {
                    Self::rope(&mut q[hh * hd..(hh + 1) * hd], t, c.rope_theta);
                }
                for hh in 0..nkv {
                    Self::rope(&mut k[hh * hd..(hh + 1) * hd], t, c.rope_theta);
                }
                qs.push(q);
                ks.push(k);
                vs.push(Self::mv(g("self_attn.v_proj.weight"), &hn));
            }
            for t in 0..xs.len() {
                let mut y = vec![0.0; nh * hd];
                for hh in 0..nh {
                    let kvh = hh / rep;
                    let q = &qs[t][hh * hd..(hh + 1) * hd];
                    let sc: Vec<f64> = (0..=t)
                        .map(|j| {
                            let k = &ks[j][kvh * hd..(kvh + 1) * hd];
                            q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                    let z: f64 = e.iter().sum();
                    for (j, ej) in e.iter().enumerate() {
                        let v = &vs[j][kvh * hd..(kvh + 1) * hd];
                        for d in 0..hd {
                            y[hh * hd + d] += ej / z * v[d];
                        }
                    }
                }
                let o = Self::mv(g("self_attn.o_proj.weight"), &y);
                for (a, b) in xs[t].iter_mut().zip(o) {
                    *a += b;
                }
                let hn = Self::rms(&xs[t], g("post_attention_layernorm.weight"), c.rms_norm_eps);
                let gt = Self::mv(g("mlp.gate_proj.weight"), &hn);
                let up = Self::mv(g("mlp.up_proj.weight"), &hn);
                let act: Vec<f64> = gt
                    .iter()
                    .zip(&up)
                    .map(|(a, u)| a / (1.0 + (-a).exp()) * u)
                    .collect();
                let d = Self::mv(g("mlp.down_proj.weight"), &act);
                for (a, b) in xs[t].iter_mut().zip(d) {
                    *a += b;
                }
            }
        }
        let head = if c.tie_word_embeddings {
            self.get("model.embed_tokens.weight")
        } else {
            self.get("lm_head.weight")
        };
        xs.iter()
            .map(|x| {
                Self::mv(
                    head,
                    &Self::rms(x, self.get("model.norm.weight"), c.rms_norm_eps),
                )
            })
            .collect()
    }

    pub(super) fn log_softmax(l: &[f64], temp: f64) -> Vec<f64> {
        let m = l.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = l.iter().map(|x| ((x - m) / temp).exp()).sum::<f64>().ln();
        l.iter().map(|x| (x - m) / temp - z).collect()
    }
}
