//! REFINE: profile statistics the runtime uses to update its beliefs about neurons it has not seen
//! yet from those it has, and to rank what stays cached. See FORMAT.md §9.

use crate::codec::{Dec, Enc};
use crate::FormatError;

#[derive(Debug, Clone, PartialEq)]
pub struct RefineLayer {
    /// Per cluster: probability that at least one of its neurons is active for a token.
    pub cluster_freq: Vec<f32>,
    /// Per cluster, its `k` strongest partners: `(cluster, P(partner active | this cluster active))`,
    /// strongest first.
    pub neighbours: Vec<Vec<(u32, f32)>>,
    /// Per neuron in stored order: activation frequency on the profile.
    pub neuron_freq: Vec<f32>,
    /// Per neuron in stored order: mean `|act(gate·x)|` over the tokens where it is active.
    pub neuron_mag: Vec<f32>,
}

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Refine {
    pub layers: Vec<RefineLayer>,
}

impl Refine {
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        e.u32(self.layers.len() as u32);
        for l in &self.layers {
            let k = l.neighbours.first().map_or(0, Vec::len);
            e.u32(l.cluster_freq.len() as u32);
            e.u32(k as u32);
            e.u32(l.neuron_freq.len() as u32);
            e.f32s(&l.cluster_freq);
            for nb in &l.neighbours {
                assert_eq!(
                    nb.len(),
                    k,
                    "every cluster lists the same number of neighbours"
                );
                nb.iter().for_each(|(c, _)| e.u32(*c));
                nb.iter().for_each(|(_, p)| e.f32(*p));
            }
            e.f32s(&l.neuron_freq);
            e.f32s(&l.neuron_mag);
        }
        e.buf
    }

    pub fn decode(d: &mut Dec) -> Result<Self, FormatError> {
        let n = d.count(12)?;
        let mut layers = Vec::with_capacity(n);
        for li in 0..n {
            let clusters = d.count(4)?;
            let k = d.count(0)?;
            let neurons = d.count(8)?;
            let cluster_freq = d.f32s(clusters)?;
            let mut neighbours = Vec::with_capacity(clusters);
            for _ in 0..clusters {
                let ids = d.u32s(k)?;
                if ids.iter().any(|&c| c as usize >= clusters) {
                    return Err(d.invalid(format!("layer {li}: a neighbour is out of range")));
                }
                let probs = d.f32s(k)?;
                neighbours.push(ids.into_iter().zip(probs).collect());
            }
            let neuron_freq = d.f32s(neurons)?;
            let neuron_mag = d.f32s(neurons)?;
            layers.push(RefineLayer {
                cluster_freq,
                neighbours,
                neuron_freq,
                neuron_mag,
            });
        }
        Ok(Self { layers })
    }
}
