//! One decoded token for each of several sequences in one forward pass (a server's concurrent
//! requests): attention per sequence over its own KV cache at its own position; the projections,
//! and the FFN through its backend, for all rows together, so that a streaming backend reads each
//! cluster once for the union of the rows' needs. Every row's logits are bitwise those of decoding
//! its token alone: block-encoded projections multiply each row on the integer kernels (bitwise a
//! mat-vec), float ones one row at a time, and the backend's chunk path sums each row's clusters as
//! decoding does.

use anyhow::{bail, Result};

use super::attention::add_output;
use super::dense_ffn::Ffn;
use super::norm::{rms_norm, rms_norm_in_place};
use super::{Attention, BatchBuffers, DenseWeights, FfnBackend, FfnWeights, Layer, Model, Scratch};
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::rope::Rope;

impl Model {
    /// Runs `tokens[i]` at the position following those in `caches[i]`, for every `i`, appending
    /// each one's keys and values to its own cache; `logits` gets one row per token
    /// (`tokens.len() × vocab`). The FFNs are computed by `backend` (`None`: the resident
    /// weights, which must be block-encoded, [`Model::batches_bitwise`]), the projections taken
    /// from `dense` (`None`: the model's own).
    pub fn forward_batch_with(
        &self,
        tokens: &[u32],
        caches: &mut [&mut KvCache],
        mut backend: Option<&mut dyn FfnBackend>,
        dense: Option<&mut dyn DenseWeights>,
        logits: &mut Vec<f32>,
    ) -> Result<()> {
        let t = tokens.len();
        if t == 0 || caches.len() != t {
            bail!(
                "a batch needs one KV cache per token ({} tokens, {} caches)",
                t,
                caches.len()
            );
        }
        if let Some(full) = caches.iter().find(|c| c.len() >= c.capacity()) {
            bail!(
                "context full: {} positions needed, the cache holds {}",
                full.len() + 1,
                full.capacity()
            );
        }
        if backend.is_none() && !self.batches_bitwise() {
            bail!("a batch over resident float FFN weights would not give each row its own bits");
        }
        let mut own;
        let dense: &mut dyn DenseWeights = match dense {
            Some(d) => d,
            None => {
                own = self.own()?;
                &mut own
            }
        };
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let kept = self.batch.lock().expect("never poisoned").take();
        let BatchBuffers {
            rows,
            mut x,
            mut s,
            mut positions,
            mut row,
        } = match kept {
            Some(b) if b.rows >= t => b,
            _ => BatchBuffers {
                rows: t,
                x: Vec::with_capacity(t * h),
                s: Scratch::new(c, t),
                positions: Vec::with_capacity(t),
                row: Vec::new(),
            },
        };
        positions.clear();
        positions.extend(caches.iter().map(|c| c.len()));
        // Grown once to the longest context: no step's scores reallocate.
        s.scores.clear();
        s.scores
            .reserve(caches.iter().map(|c| c.capacity()).max().unwrap_or(0));
        self.embed_into(tokens, dense, &mut x)?;
        let half = hd / 2;
        let ropes = [(&self.rope, &mut s.rope)]
            .into_iter()
            .chain(self.rope_local.as_ref().map(|r| (r, &mut s.rope_local)));
        for (rope, tables) in ropes {
            for ((&p, cache), table) in positions
                .iter()
                .zip(caches.iter())
                .zip(tables.chunks_exact_mut(2 * half))
            {
                let (cos, sin) = table.split_at_mut(half);
                rope.tables_into(p, cache.capacity(), cos, sin);
            }
        }
        for l in 0..self.layers.len() {
            let ffn = match backend.as_deref_mut() {
                Some(b) => {
                    b.begin_layer(l, &x)?;
                    Ffn::Backend(b)
                }
                None => Ffn::Resident(None),
            };
            let attn = dense.attention(l)?;
            let layer = &self.layers[l];
            self.attention_rows(l, layer, attn, &positions, &mut x, caches, &mut s);
            self.ffn_block(l, layer, t, &mut x, &mut s, ffn)?;
        }
        caches.iter_mut().for_each(|c| c.advance(1));
        if dense.head_rows_bitwise() {
            // Every row through the head at once: a streamed head is read once for the batch.
            self.logits_with(&x, dense, &mut s.xn, logits)?;
        } else {
            logits.clear();
            logits.resize(t * c.vocab_size, 0.0);
            // A float head sums several rows in another order: one row at a time (a streamed
            // one read for each).
            for (x, out) in x.chunks_exact(h).zip(logits.chunks_exact_mut(c.vocab_size)) {
                self.logits_with(x, dense, &mut s.xn, &mut row)?;
                out.copy_from_slice(&row);
            }
        }
        *self.batch.lock().expect("never poisoned") = Some(BatchBuffers {
            rows,
            x,
            s,
            positions,
            row,
        });
        Ok(())
    }

    /// Whether a batch may run on the resident FFN weights with every row's bits those of
    /// decoding it alone: every layer's FFN dense and block-encoded (each row on the integer
    /// kernels, bitwise a mat-vec); float weights' multi-row kernel sums in another order, and
    /// experts route each row.
    pub fn batches_bitwise(&self) -> bool {
        self.layers.iter().all(|l| match &l.ffn {
            Some(FfnWeights::Dense(f)) => [&f.gate, &f.up, &f.down]
                .iter()
                .all(|w| w.qtype().is_block()),
            _ => false,
        })
    }

    /// [`Model::attention_block`] for rows of different sequences: row `i` at `positions[i]` of
    /// `caches[i]`, each attending as a decoded token does.
    #[allow(clippy::too_many_arguments)]
    fn attention_rows(
        &self,
        l: usize,
        layer: &Layer,
        attn: &Attention,
        positions: &[usize],
        x: &mut [f32],
        caches: &mut [&mut KvCache],
        s: &mut Scratch,
    ) {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let t = x.len() / h;
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        for (src, dst) in x.chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
            rms_norm(src, &layer.attn_norm, c.rms_norm_eps, dst);
        }
        rows_matmul(&attn.wq, &s.xn[..t * h], &mut s.q[..t * qd]);
        rows_matmul(&attn.wk, &s.xn[..t * h], &mut s.k[..t * kvd]);
        rows_matmul(&attn.wv, &s.xn[..t * h], &mut s.v[..t * kvd]);
        if let Some(b) = &layer.qkv_bias {
            let (bq, bkv) = b.split_at(qd);
            let (bk, bv) = bkv.split_at(kvd);
            for (m, bias) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                for row in m[..t * bias.len()].chunks_exact_mut(bias.len()) {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
            }
        }
        let tables = match c.window(l) {
            Some(_) if !s.rope_local.is_empty() => &s.rope_local,
            _ => &s.rope,
        };
        for i in 0..t {
            let q = &mut s.q[i * qd..(i + 1) * qd];
            let k = &mut s.k[i * kvd..(i + 1) * kvd];
            let (cos, sin) = tables[i * hd..(i + 1) * hd].split_at(hd / 2);
            if let (Some(qn), Some(kn)) = (&layer.q_norm, &layer.k_norm) {
                q.chunks_exact_mut(hd)
                    .for_each(|head| rms_norm_in_place(head, qn, c.rms_norm_eps));
                k.chunks_exact_mut(hd)
                    .for_each(|head| rms_norm_in_place(head, kn, c.rms_norm_eps));
            }
            if c.uses_rope(l) {
                Rope::apply(q, hd, cos, sin);
                Rope::apply(k, hd, cos, sin);
            }
            caches[i].store(l, positions[i], k, &s.v[i * kvd..(i + 1) * kvd]);
            self.attend(
                l,
                positions[i],
                1,
                &s.q[i * qd..(i + 1) * qd],
                caches[i],
                &mut s.scores,
                &mut s.att[i * qd..(i + 1) * qd],
            );
        }
        rows_matmul(&attn.wo, &s.att[..t * qd], &mut s.proj[..t * h]);
        add_output(
            layer.attn_post_norm.as_deref(),
            c.rms_norm_eps,
            x,
            &mut s.proj,
        );
    }
}

/// `v` emptied, its allocation kept for elements of another type of the same size and alignment
/// (here: the same type borrowing for another lifetime), so that buffers of borrowed items can be
/// kept from one step to the next. The standard library collects a `vec::IntoIter` mapped to such
/// a type in place: this allocates nothing.
pub fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().map(|_| unreachable!("emptied")).collect()
}

/// `out = x · wᵀ` for the rows of `x`, each bitwise what multiplying that row alone gives: block
/// encodings multiply every row on the integer kernels (each a mat-vec's bits), float weights
/// (whose multi-row kernel sums in another order) one row at a time.
fn rows_matmul(w: &Weight, x: &[f32], out: &mut [f32]) {
    let t = x.len() / w.cols();
    if w.qtype().is_block() {
        w.matmul_t(x, t, out);
    } else {
        for (x, out) in x.chunks_exact(w.cols()).zip(out.chunks_exact_mut(w.rows())) {
            w.matmul_t(x, 1, out);
        }
    }
}
