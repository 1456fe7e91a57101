//! AdamW with checkpointable state. candle-nn's `AdamW` keeps its moments
//! private, so a run could not be resumed exactly with it; this one exposes
//! them for checkpoints. Weight decay is decoupled and applied to matrices
//! only (not to norm gains), as is usual for transformers.

use std::collections::HashMap;

use candle_core::{Result, Tensor, Var};

/// Hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

/// AdamW over named variables.
pub struct AdamW {
    vars: Vec<(String, Var)>,
    m: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Number of updates applied.
    pub t: u64,
    pub params: AdamWParams,
}

impl AdamW {
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let m = vars
            .iter()
            .map(|(_, v)| v.as_tensor().zeros_like())
            .collect::<Result<Vec<_>>>()?;
        let v = m.clone();
        Ok(AdamW {
            vars,
            m,
            v,
            t: 0,
            params,
        })
    }

    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// One update with gradients aligned to `vars()` (None = no gradient).
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        self.t += 1;
        let p = self.params;
        let bc1 = 1.0 - p.beta1.powi(self.t as i32);
        let bc2 = 1.0 - p.beta2.powi(self.t as i32);
        for (i, (_, var)) in self.vars.iter().enumerate() {
            let Some(g) = &grads[i] else { continue };
            let m = ((&self.m[i] * p.beta1)? + (g * (1.0 - p.beta1))?)?;
            let v = ((&self.v[i] * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let update = ((&m / bc1)? / ((&v / bc2)?.sqrt()? + p.eps)?)?;
            let w = var.as_tensor();
            let mut new = (w - (update * lr)?)?;
            if p.weight_decay > 0.0 && w.rank() >= 2 {
                new = (new - (w * (lr * p.weight_decay))?)?;
            }
            var.set(&new)?;
            self.m[i] = m;
            self.v[i] = v;
        }
        Ok(())
    }

    /// Moments by name (`m.<param>`, `v.<param>`) for a checkpoint.
    pub fn state_tensors(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            out.insert(format!("m.{name}"), self.m[i].clone());
            out.insert(format!("v.{name}"), self.v[i].clone());
        }
        out
    }

    /// Restore moments saved by `state_tensors`.
    pub fn load_state(
        &mut self,
        tensors: &HashMap<String, Tensor>,
        t: u64,
    ) -> std::result::Result<(), String> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            for (slot, key) in [(0, format!("m.{name}")), (1, format!("v.{name}"))] {
                let x = tensors
                    .get(&key)
                    .ok_or_else(|| format!("optimizer state lacks `{key}`"))?;
                if x.dims() != var.dims() {
                    return Err(format!(
                        "optimizer state `{key}` has shape {:?}, expected {:?}",
                        x.dims(),
                        var.dims()
                    ));
                }
                let x = x.to_device(var.device()).map_err(|e| e.to_string())?;
                if slot == 0 {
                    self.m[i] = x;
                } else {
                    self.v[i] = x;
                }
            }
        }
        self.t = t;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn adamw_minimises_a_quadratic_and_matches_closed_form_first_step() {
        let x = Var::new(&[3.0f32, -2.0], &Device::Cpu).unwrap();
        let mut opt = AdamW::new(
            vec![("x".into(), x.clone())],
            AdamWParams {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
                weight_decay: 0.0,
            },
        )
        .unwrap();
        // First Adam step moves each coordinate by lr·sign(g).
        let g = (x.as_tensor() * 2.0).unwrap();
        opt.step(&[Some(g)], 0.1).unwrap();
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(
            (v[0] - 2.9).abs() < 1e-5 && (v[1] + 1.9).abs() < 1e-5,
            "{v:?}"
        );
        for _ in 0..300 {
            let g = (x.as_tensor() * 2.0).unwrap();
            opt.step(&[Some(g)], 0.05).unwrap();
        }
        let v = x.as_tensor().to_vec1::<f32>().unwrap();
        assert!(v[0].abs() < 0.05 && v[1].abs() < 0.05, "{v:?}");
    }
}
