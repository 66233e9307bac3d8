// After the q/k/v projections of one token at position `step.pos`: the biases added (Qwen2; a
// zero vector otherwise), the rotary embedding applied to the query and key heads (Hugging Face's
// "rotate half": dimension i with i + d/2, the CPU's `Rope::apply`), and the key and value stored
// in this layer's cache (`[kv_head][position][d]`, f32) and in `kv_out` (this token's keys then
// values of every layer, read back with the logits for the CPU's KV cache). The cos and sin of
// each frequency come from the CPU (`table`: d/2 cosines, then d/2 sines), so every rope variant
// the CPU supports (Llama 3 scaling, LongRoPE, frequency factors) is the CPU's. One invocation per
// rotated pair of a query head, per rotated pair of a key head, and per value.

struct Params {
    heads: u32,
    kv_heads: u32,
    hd: u32,
    capacity: u32,
    // 0: this layer has no rope (SmolLM3's NoPE layers).
    rope: u32,
    // Where this layer's keys start in `kv_out` (its values follow, kv_heads·d later).
    kv_base: u32,
    pad0: u32,
    pad1: u32,
}

struct Step {
    pos: u32,
    len: u32,
    pad0: u32,
    pad1: u32,
}

@group(0) @binding(0) var<storage, read_write> q: array<f32>;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read> table: array<f32>;
@group(0) @binding(5) var<storage, read_write> kc: array<f32>;
@group(0) @binding(6) var<storage, read_write> vc: array<f32>;
@group(0) @binding(7) var<storage, read_write> kv_out: array<f32>;
@group(0) @binding(8) var<uniform> step: Step;
@group(0) @binding(9) var<uniform> p: Params;

// `(a, b)` turned by frequency `j`: `(a·cos − b·sin, b·cos + a·sin)`.
fn turn(a: f32, b: f32, j: u32) -> vec2<f32> {
    if p.rope == 0u {
        return vec2<f32>(a, b);
    }
    let half = p.hd / 2u;
    let c = table[j];
    let s = table[half + j];
    return vec2<f32>(a * c - b * s, b * c + a * s);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let half = p.hd / 2u;
    let nq = p.heads * half;
    let nk = p.kv_heads * half;
    let kvd = p.kv_heads * p.hd;
    let qd = p.heads * p.hd;
    let i = gid.x;
    if i < nq {
        let at = (i / half) * p.hd + i % half;
        let r = turn(q[at] + bias[at], q[at + half] + bias[at + half], i % half);
        q[at] = r.x;
        q[at + half] = r.y;
    } else if i < nq + nk {
        let head = (i - nq) / half;
        let j = (i - nq) % half;
        let at = head * p.hd + j;
        let r = turn(k[at] + bias[qd + at], k[at + half] + bias[qd + at + half], j);
        let row = (head * p.capacity + step.pos) * p.hd;
        kc[row + j] = r.x;
        kc[row + j + half] = r.y;
        kv_out[p.kv_base + at] = r.x;
        kv_out[p.kv_base + at + half] = r.y;
    } else if i < nq + nk + kvd {
        let at = i - nq - nk;
        let head = at / p.hd;
        let val = v[at] + bias[qd + kvd + at];
        vc[(head * p.capacity + step.pos) * p.hd + at % p.hd] = val;
        kv_out[p.kv_base + kvd + at] = val;
    }
}
