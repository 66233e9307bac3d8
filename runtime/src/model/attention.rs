//! The attention half of a transformer block: RMSNorm, q/k/v projections, Qwen3's per-head q/k
//! norms, rotary embeddings, causal (optionally sliding-window) softmax attention over the KV cache
//! and the output projection added to the residual. Every FFN block type shares it.

use rayon::prelude::*;

use super::norm::{rms_norm, rms_norm_in_place};
use super::{Layer, Model, Scratch};
use crate::kernels::Weight;
use crate::model::kv_cache::KvCache;
use crate::model::rope::Rope;

/// A block's attention projections: q `[heads·d, h]`, k and v `[kv_heads·d, h]`, o `[h, heads·d]`.
pub struct Attention {
    pub wq: Weight,
    pub wk: Weight,
    pub wv: Weight,
    pub wo: Weight,
}

impl Model {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attention_block(
        &self,
        l: usize,
        layer: &Layer,
        attn: &Attention,
        start: usize,
        x: &mut [f32],
        cache: &mut KvCache,
        s: &mut Scratch,
    ) {
        let c = &self.config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let t = x.len() / h;
        let (qd, kvd) = (c.num_heads * hd, c.num_kv_heads * hd);
        for (src, dst) in x.chunks_exact(h).zip(s.xn.chunks_exact_mut(h)) {
            rms_norm(src, &layer.attn_norm, c.rms_norm_eps, dst);
        }
        let whole = self.whole_products;
        attn.wq.matmul_t_with(&s.xn, t, &mut s.q, whole);
        attn.wk.matmul_t_with(&s.xn, t, &mut s.k, whole);
        attn.wv.matmul_t_with(&s.xn, t, &mut s.v, whole);
        if let Some(b) = &layer.qkv_bias {
            let (bq, bkv) = b.split_at(qd);
            let (bk, bv) = bkv.split_at(kvd);
            for (m, bias) in [(&mut s.q, bq), (&mut s.k, bk), (&mut s.v, bv)] {
                for row in m[..t * bias.len()].chunks_exact_mut(bias.len()) {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
            }
        }
        let rows = s.q.chunks_exact_mut(qd).zip(s.k.chunks_exact_mut(kvd));
        // Gemma 3's sliding-window layers turn by their own rope.
        let tables = match c.window(l) {
            Some(_) if !s.rope_local.is_empty() => &s.rope_local,
            _ => &s.rope,
        };
        for (i, ((q, k), table)) in rows.zip(tables.chunks_exact(hd)).enumerate() {
            let (cos, sin) = table.split_at(hd / 2);
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
            cache.store(l, start + i, k, &s.v[i * kvd..(i + 1) * kvd]);
        }
        self.attend(l, start, t, &s.q, cache, &mut s.scores, &mut s.att);
        attn.wo.matmul_t_with(&s.att, t, &mut s.proj, whole);
        add_output(
            layer.attn_post_norm.as_deref(),
            c.rms_norm_eps,
            x,
            &mut s.proj,
        );
    }

    /// Causal softmax attention of `t` queries at positions `start..start+t` over the cache;
    /// `scores` is one head's scratch on the calling thread (each parallel task has its own).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn attend(
        &self,
        l: usize,
        start: usize,
        t: usize,
        q: &[f32],
        cache: &KvCache,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let c = &self.config;
        let (hd, nh, group) = (c.head_dim, c.num_heads, c.gqa_group());
        let scale = match c.block.query_pre_attn_scalar {
            Some(s) => (1.0 / (s as f64).sqrt()) as f32,
            None => 1.0 / (hd as f32).sqrt(),
        };
        let (window, cap) = (c.window(l), c.block.attn_logit_softcap);
        let one = |scores: &mut Vec<f32>, idx: usize, o: &mut [f32]| {
            let (i, head) = (idx / nh, idx % nh);
            let pos = start + i;
            let lo = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let qh = &q[idx * hd..(idx + 1) * hd];
            scores.clear();
            scores.resize(pos + 1 - lo, 0.0);
            cache.attend(l, head / group, lo, pos + 1, qh, scale, cap, scores, o);
        };
        let work = t * nh * (start + t) * hd;
        if work >= 1 << 16 && rayon::current_num_threads() > 1 {
            out.par_chunks_mut(hd)
                .enumerate()
                .for_each_init(Vec::new, |scores, (idx, o)| one(scores, idx, o));
        } else {
            out.chunks_mut(hd)
                .enumerate()
                .for_each(|(idx, o)| one(scores, idx, o));
        }
    }
}

/// Adds a block's output `out` (`t × hidden`) to the residual stream `x`, after normalising each
/// row with `post_norm` when the block has one (Gemma); `out` is overwritten.
pub(super) fn add_output(post_norm: Option<&[f32]>, eps: f32, x: &mut [f32], out: &mut [f32]) {
    let out = &mut out[..x.len()];
    if let Some(w) = post_norm {
        out.chunks_exact_mut(w.len())
            .for_each(|row| rms_norm_in_place(row, w, eps));
    }
    x.iter_mut().zip(out.iter()).for_each(|(a, b)| *a += b);
}
