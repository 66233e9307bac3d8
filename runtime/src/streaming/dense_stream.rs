//! The dense weights of a forward pass — embedding, attention projections, output head — resident
//! or, when the planner says so ([`DenseStreamed`]), read from flash as they are used, through the
//! same read queue and device as the FFN bundles (so the page cache never serves them and an
//! emulated flash times them):
//! - attention: layer `l + 1`'s four projections are read (whole extents, checked against their
//!   index checksums) while layer `l` computes; after the last layer, the next token's layer 0;
//! - output head: read in row blocks every token, [`HEAD_IN_FLIGHT`] blocks ahead, each computed
//!   as it lands; past the last block, the next token's first blocks are queued at the lowest
//!   priority, so they fill idle device time;
//! - embedding: each token's row, read when the token is known.
//!
//! The head and embedding reads cover only part of a tensor's extent, which the format checksums
//! only as a whole. So when the stream opens, each streamed table is read once, whole, checked
//! against its index checksum, and hashed page by page ([`PAGE`] bytes, 0.2 % of the table); every
//! later partial read is checked against those page hashes before its bytes are used.
//!
//! Streamed weights run through the same kernels on the same encoded bytes as resident ones (the
//! head through [`RowStream`], which is how a resident matrix computes too), so the results are
//! bit-identical — also when a new budget moves a part between resident and streamed while the
//! model runs ([`DenseStream::set_streamed`]): resident weights are read through the same queue,
//! checked whole against their index checksums.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::fs::File;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use leanstream_format::container::{checksum, Checksum};
use leanstream_format::dense::DenseTensor;
use leanstream_format::file::check_extent;
use leanstream_format::quant::{dequantize_row, QuantType};
use leanstream_format::{FormatError, LsbFile};

use super::engine::{SPECULATIVE_MAX, URGENT};
use super::planner::{DenseSizes, DenseStreamed};
use crate::kernels::{QMatrix, RowKernels, RowStream, Weight};
use crate::model::{Attention, DenseWeights};
use crate::source::config::ModelConfig;
use crate::storage::{AlignedBuf, IoQueue, SpareBuffers, Ticket};

/// The device page: the unit of direct reads and of the page hashes.
const PAGE: usize = AlignedBuf::ALIGN;
/// Layers whose attention projections are read ahead of the one computing. One suffices: on the
/// emulated UFS 4.0 the reads have landed when their layer starts (measured waits under 1 µs on
/// SmolLM2), and each more costs a layer's projections of memory.
const ATTENTION_AHEAD: usize = 1;
/// Bytes of one output-head row block (rounded to whole rows): a sixteenth of the head, within
/// these bounds — large enough to read at the device's bandwidth, small enough that the blocks in
/// flight are a small part of the head they replace.
const HEAD_BLOCK_BYTES: (usize, usize) = (64 << 10, 1 << 20);
/// Head blocks read ahead of the one being computed.
const HEAD_IN_FLIGHT: usize = 4;
/// Embedding rows read at once for a prompt chunk.
const EMBED_ROWS_IN_FLIGHT: usize = 16;
/// Bytes read at a time when a streamed table is checked at open.
const CHECK_CHUNK: usize = 1 << 20;
/// The next layer's attention reads: ahead of every speculative FFN read (they are certain to be
/// needed), behind the current layer's urgent ones.
const AHEAD: u32 = SPECULATIVE_MAX + 1;
/// The next token's head blocks: only when nothing else waits.
const IDLE: u32 = 0;

/// A dense tensor's extent in the file and what it holds.
#[derive(Debug, Clone)]
struct Extent {
    name: String,
    /// File offset (page-aligned).
    offset: u64,
    /// Bytes of the extent (whole pages).
    len: usize,
    /// Bytes of encoded data at its start.
    size: usize,
    checksum: u64,
    rows: usize,
    cols: usize,
    qtype: QuantType,
}

impl Extent {
    fn row_bytes(&self) -> usize {
        self.size / self.rows.max(1)
    }
}

/// The dense tensors of an open file, looked up by name with the shapes the config implies.
pub struct DenseTensors<'a> {
    file: &'a LsbFile,
    reader: RefCell<File>,
}

impl<'a> DenseTensors<'a> {
    pub fn open(file: &'a LsbFile) -> Result<Self> {
        let reader = File::open(&file.path)
            .with_context(|| format!("cannot open {}", file.path.display()))?;
        Ok(Self {
            file,
            reader: RefCell::new(reader),
        })
    }

    fn tensor(&self, name: &str, shape: &[usize]) -> Result<&'a DenseTensor> {
        let path = self.file.path.display();
        let t = self
            .file
            .dense
            .get(name)
            .with_context(|| format!("{path}: tensor {name} is missing"))?;
        if t.shape
            .iter()
            .map(|&d| d as usize)
            .ne(shape.iter().copied())
        {
            bail!(
                "{path}: tensor {name} has shape {:?}, the config implies {shape:?}",
                t.shape
            );
        }
        Ok(t)
    }

    fn read(&self, t: &DenseTensor) -> Result<Vec<u8>> {
        Ok(self.file.read_dense(&mut self.reader.borrow_mut(), t)?)
    }

    /// A 1-D tensor (a norm weight) as f32.
    pub fn vector(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let t = self.tensor(name, shape)?;
        let mut v = vec![0.0f32; shape.iter().product()];
        dequantize_row(t.qtype, &self.read(t)?, &mut v)?;
        Ok(v)
    }

    fn extent(&self, name: &str, rows: usize, cols: usize) -> Result<Extent> {
        let t = self.tensor(name, &[rows, cols])?;
        let (offset, len) = self.file.dense_extent(t);
        Ok(Extent {
            name: name.to_string(),
            offset,
            len: len as usize,
            size: t.size as usize,
            checksum: t.checksum,
            rows,
            cols,
            qtype: t.qtype,
        })
    }

    fn attention_extents(&self, c: &ModelConfig) -> Result<Vec<[Extent; 4]>> {
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (q, kv) = (c.num_heads * hd, c.num_kv_heads * hd);
        (0..c.num_layers)
            .map(|l| {
                let p = format!("model.layers.{l}.self_attn");
                let e =
                    |name: &str, rows, cols| self.extent(&format!("{p}.{name}.weight"), rows, cols);
                Ok([
                    e("q_proj", q, h)?,
                    e("k_proj", kv, h)?,
                    e("v_proj", kv, h)?,
                    e("o_proj", h, q)?,
                ])
            })
            .collect()
    }

    fn embedding(&self, c: &ModelConfig) -> Result<Extent> {
        self.extent("model.embed_tokens.weight", c.vocab_size, c.hidden_size)
    }

    fn head(&self, c: &ModelConfig) -> Result<Option<Extent>> {
        if c.tie_word_embeddings {
            return Ok(None);
        }
        Ok(Some(self.extent(
            "lm_head.weight",
            c.vocab_size,
            c.hidden_size,
        )?))
    }

    /// What the planner needs: the dense bytes by part, and the buffers each part needs to stream.
    pub fn sizes(&self, c: &ModelConfig) -> Result<DenseSizes> {
        let attention = self.attention_extents(c)?;
        let layer_len = |l: &[Extent; 4]| l.iter().map(|e| e.len).sum::<usize>() as u64;
        let layer_size = |l: &[Extent; 4]| l.iter().map(|e| e.size).sum::<usize>() as u64;
        let embedding = self.embedding(c)?;
        let head = self.head(c)?;
        // A tied head streams the embedding's blocks; its page hashes count with the embedding.
        let head_buffers = head_buffers(head.as_ref().unwrap_or(&embedding))
            + head.as_ref().map_or(0, |h| hash_bytes(h.len));
        Ok(DenseSizes {
            total: self.file.dense.data_bytes(),
            attention: attention.iter().map(layer_size).sum(),
            // The layer being computed (copied out of its buffers) and the reads ahead.
            attention_buffers: attention.iter().map(layer_size).max().unwrap_or(0)
                + ATTENTION_AHEAD.min(attention.len()) as u64
                    * attention.iter().map(layer_len).max().unwrap_or(0),
            head: head.as_ref().map_or(0, |h| h.size as u64),
            head_buffers,
            embedding: embedding.size as u64,
            embedding_buffers: EMBED_ROWS_IN_FLIGHT as u64 * row_span(&embedding) as u64
                + hash_bytes(embedding.len),
            tied: head.is_none(),
        })
    }
}

/// Bytes of one page-aligned read covering any single row.
fn row_span(e: &Extent) -> usize {
    (e.row_bytes().div_ceil(PAGE) + 1) * PAGE
}

fn block_rows(e: &Extent) -> usize {
    let bytes = (e.size / 16).clamp(HEAD_BLOCK_BYTES.0, HEAD_BLOCK_BYTES.1);
    (bytes / e.row_bytes().max(1)).clamp(1, e.rows)
}

fn head_buffers(e: &Extent) -> u64 {
    let blocks = e.rows.div_ceil(block_rows(e)).min(HEAD_IN_FLIGHT);
    (blocks * ((block_rows(e) * e.row_bytes()).div_ceil(PAGE) + 1) * PAGE) as u64
}

fn hash_bytes(extent_len: usize) -> u64 {
    (extent_len.div_ceil(PAGE) * std::mem::size_of::<u64>()) as u64
}

/// The read queue as the dense stream uses it, counting what it reads.
struct Reader {
    queue: Arc<IoQueue>,
    bytes: u64,
    reads: u64,
}

impl Reader {
    /// Queues a read into a spare buffer of its length if there is one.
    fn submit(
        &mut self,
        offset: u64,
        len: usize,
        priority: u32,
        spares: &mut SpareBuffers,
    ) -> Ticket {
        self.bytes += len as u64;
        self.reads += 1;
        self.queue.submit_into(spares.take(len), offset, priority)
    }

    /// Waits for a read, raising it to the top of the queue first: it is needed now.
    fn wait(&self, ticket: Ticket, what: &str) -> Result<AlignedBuf> {
        self.queue.boost(ticket, URGENT);
        self.queue
            .wait(ticket)
            .with_context(|| format!("reading {what}"))
    }

    /// Drops a read no longer wanted, reclaiming its buffer if it was already issued.
    fn discard(&self, ticket: Ticket) {
        if !self.queue.cancel(ticket) {
            let _ = self.queue.wait(ticket);
        }
    }
}

/// Attention projections read [`ATTENTION_AHEAD`] layers ahead.
struct AttentionStream {
    layers: Vec<[Extent; 4]>,
    /// The layer being computed.
    current: Option<Attention>,
    /// The reads of the layers expected next, in order.
    ahead: VecDeque<(usize, [Ticket; 4])>,
    /// The buffers of the layer last read, for the next layer's reads.
    spares: SpareBuffers,
}

impl AttentionStream {
    fn submit(&mut self, io: &mut Reader, l: usize, priority: u32) -> [Ticket; 4] {
        let spares = &mut self.spares;
        self.layers[l]
            .each_ref()
            .map(|e| io.submit(e.offset, e.len, priority, spares))
    }

    /// Queues the reads of the layers after those queued, from `first` when none are.
    fn queue_ahead(&mut self, io: &mut Reader, first: usize) {
        let n = self.layers.len();
        while self.ahead.len() < ATTENTION_AHEAD.min(n) {
            let l = self.ahead.back().map_or(first, |&(last, _)| (last + 1) % n);
            let tickets = self.submit(io, l, AHEAD);
            self.ahead.push_back((l, tickets));
        }
    }

    fn get(&mut self, io: &mut Reader, l: usize) -> Result<&Attention> {
        let tickets = match self.ahead.front() {
            Some(&(next, _)) if next == l => self.ahead.pop_front().expect("just seen").1,
            _ => {
                self.ahead
                    .drain(..)
                    .flat_map(|(_, t)| t)
                    .for_each(|t| io.discard(t));
                self.submit(io, l, URGENT)
            }
        };
        // The previous layer's reads go back to the spares for the reads ahead: this layer's
        // matrices are computed in their own reads, beside the reads ahead in memory at most.
        if let Some(a) = self.current.take() {
            for w in [a.wq, a.wk, a.wv, a.wo] {
                if let Weight::Encoded(q) = w {
                    self.spares.give(q.into_read().expect("made in its read"));
                }
            }
        }
        let layer = &self.layers[l];
        let mut weights = [0, 1, 2, 3].map(|_| None);
        for ((e, ticket), w) in layer.iter().zip(tickets).zip(&mut weights) {
            let buf = io.wait(ticket, &e.name)?;
            check_extent(&buf, e.checksum, || {
                format!("{}: tensor {}", io.queue.device().name(), e.name)
            })?;
            *w = Some(Weight::Encoded(QMatrix::in_read(
                e.rows, e.cols, e.qtype, buf, e.size,
            )?));
        }
        let [wq, wk, wv, wo] = weights.map(|w| w.expect("each waited for above"));
        self.queue_ahead(io, (l + 1) % self.layers.len());
        Ok(self.current.insert(Attention { wq, wk, wv, wo }))
    }
}

/// An embedding or output head read in parts, each checked against page hashes.
struct TableStream {
    e: Extent,
    /// XXH3 of each page of the extent, taken in the pass that checked it whole at open.
    pages: Vec<u64>,
    block_rows: usize,
    /// Head blocks queued, in order: (first row, ticket).
    in_flight: VecDeque<(usize, Ticket)>,
    /// The buffer of the block last computed, for the next block's read.
    spares: SpareBuffers,
}

impl TableStream {
    /// Reads the extent once, whole: checks it against its index checksum and keeps the hash of
    /// each page.
    fn open(io: &mut Reader, e: Extent) -> Result<Self> {
        let mut pages = Vec::with_capacity(e.len / PAGE);
        read_checked(io, &e, |chunk| {
            pages.extend(chunk.chunks(PAGE).map(checksum))
        })?;
        let block_rows = block_rows(&e);
        // One block's read: its rows' pages, one more where they straddle a page boundary.
        let block_read = (block_rows * e.row_bytes()).div_ceil(PAGE) * PAGE + PAGE;
        Ok(Self {
            block_rows,
            e,
            pages,
            in_flight: VecDeque::new(),
            spares: SpareBuffers::new(block_read),
        })
    }

    /// Queues the page-aligned read covering rows `r0..r1`.
    fn submit(&mut self, io: &mut Reader, r0: usize, r1: usize, priority: u32) -> Ticket {
        let (first, last) = self.pages_of(r0, r1);
        io.submit(
            self.e.offset + (first * PAGE) as u64,
            (last - first) * PAGE,
            priority,
            &mut self.spares,
        )
    }

    /// The pages `first..last` holding rows `r0..r1`.
    fn pages_of(&self, r0: usize, r1: usize) -> (usize, usize) {
        let rb = self.e.row_bytes();
        ((r0 * rb) / PAGE, (r1 * rb).div_ceil(PAGE))
    }

    /// Waits for the read of rows `r0..r1`, checks its pages, and returns the rows' bytes.
    fn rows<'b>(
        &self,
        io: &Reader,
        buf: &'b mut Option<AlignedBuf>,
        ticket: Ticket,
        r0: usize,
        r1: usize,
    ) -> Result<&'b [u8]> {
        let b = buf.insert(io.wait(ticket, &self.e.name)?);
        let (first, _) = self.pages_of(r0, r1);
        for (i, page) in b.chunks(PAGE).enumerate() {
            if checksum(page) != self.pages[first + i] {
                return Err(FormatError::Checksum {
                    what: format!(
                        "{}: tensor {} page {}",
                        io.queue.device().name(),
                        self.e.name,
                        first + i
                    ),
                }
                .into());
            }
        }
        let rb = self.e.row_bytes();
        let skip = r0 * rb - first * PAGE;
        Ok(&b[skip..skip + (r1 - r0) * rb])
    }

    /// The embedding rows of `tokens`, a few reads in flight at a time.
    fn embed(&mut self, io: &mut Reader, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        let k = RowKernels::best();
        let h = self.e.cols;
        for (toks, rows) in tokens
            .chunks(EMBED_ROWS_IN_FLIGHT)
            .zip(out.chunks_mut(EMBED_ROWS_IN_FLIGHT * h))
        {
            let mut tickets = [None; EMBED_ROWS_IN_FLIGHT];
            for (&t, ticket) in toks.iter().zip(&mut tickets) {
                *ticket = Some(self.submit(io, t as usize, t as usize + 1, URGENT));
            }
            let tickets = tickets.into_iter().flatten();
            for ((&t, ticket), row) in toks.iter().zip(tickets).zip(rows.chunks_exact_mut(h)) {
                let mut buf = None;
                let r = t as usize;
                k.dequantize(
                    self.e.qtype,
                    self.rows(io, &mut buf, ticket, r, r + 1)?,
                    row,
                );
                self.spares.give(buf.expect("filled by rows"));
            }
        }
        Ok(())
    }

    /// Keeps [`HEAD_IN_FLIGHT`] head blocks queued, each after the last one queued; after the
    /// last block, the next token's blocks from the first, at the lowest priority.
    fn queue_blocks(&mut self, io: &mut Reader) {
        let blocks = self.e.rows.div_ceil(self.block_rows);
        while self.in_flight.len() < HEAD_IN_FLIGHT.min(blocks) {
            let (r0, priority) = match self.in_flight.back() {
                Some(&(last, _)) if last + self.block_rows < self.e.rows => {
                    (last + self.block_rows, AHEAD)
                }
                _ => (0, IDLE),
            };
            let r1 = (r0 + self.block_rows).min(self.e.rows);
            let ticket = self.submit(io, r0, r1, priority);
            self.in_flight.push_back((r0, ticket));
        }
    }

    /// `logits (rows × vocab) = xn · headᵀ`, block by block as the blocks land, the blocks after
    /// them (and then the next token's) queued as each is taken.
    fn head(&mut self, io: &mut Reader, xn: &[f32], rows: usize, logits: &mut [f32]) -> Result<()> {
        let e = &self.e;
        let vocab = e.rows;
        let mut product = RowStream::new(e.qtype, vocab, e.cols, e.row_bytes(), xn, rows);
        let mut r0 = 0;
        while r0 < vocab {
            let r1 = (r0 + self.block_rows).min(vocab);
            let ticket = match self.in_flight.front() {
                Some(&(first, _)) if first == r0 => self.in_flight.pop_front().expect("seen").1,
                _ => {
                    self.in_flight.drain(..).for_each(|(_, t)| io.discard(t));
                    self.submit(io, r0, r1, URGENT)
                }
            };
            let mut buf = None;
            product.push(self.rows(io, &mut buf, ticket, r0, r1)?, logits);
            // Only now, so that the next read reuses this block's buffer: [`HEAD_IN_FLIGHT`]
            // blocks in memory at most, the one computed included.
            self.spares.give(buf.expect("filled by rows"));
            self.queue_blocks(io);
            r0 = r1;
        }
        Ok(())
    }
}

/// Reads extent `e` whole, in chunks of [`CHECK_CHUNK`] bytes handed to `each` as they land, and
/// checks it against its index checksum.
fn read_checked(io: &mut Reader, e: &Extent, mut each: impl FnMut(&[u8])) -> Result<()> {
    let mut whole = Checksum::new();
    for start in (0..e.len).step_by(CHECK_CHUNK) {
        let len = CHECK_CHUNK.min(e.len - start);
        let ticket = io.submit(
            e.offset + start as u64,
            len,
            URGENT,
            &mut SpareBuffers::new(0),
        );
        let buf = io.wait(ticket, &e.name)?;
        whole.update(&buf);
        each(&buf);
    }
    if whole.digest() != e.checksum {
        return Err(FormatError::Checksum {
            what: format!("{}: tensor {}", io.queue.device().name(), e.name),
        }
        .into());
    }
    Ok(())
}

/// A matrix made resident: its extent read whole and checked, kept encoded as stored.
fn resident(io: &mut Reader, e: &Extent) -> Result<Weight> {
    let mut data = Vec::with_capacity(e.len);
    read_checked(io, e, |chunk| data.extend_from_slice(chunk))?;
    data.truncate(e.size);
    Ok(Weight::Encoded(
        QMatrix::new(e.rows, e.cols, e.qtype, data)?.in_groups(),
    ))
}

/// An embedding or an output head: resident, or streamed.
enum Table {
    Resident(Weight),
    Streamed(TableStream),
    /// Neither: a budget change failed to read it again ([`DenseStream::set_streamed`]).
    Unloaded,
}

impl Table {
    fn open(io: &mut Reader, e: &Extent, streamed: bool) -> Result<Self> {
        Ok(if streamed {
            Table::Streamed(TableStream::open(io, e.clone())?)
        } else {
            Table::Resident(resident(io, e)?)
        })
    }

    /// Drops the table, withdrawing its reads in flight.
    fn unload(&mut self, io: &Reader) {
        if let Table::Streamed(s) = self {
            s.in_flight.drain(..).for_each(|(_, t)| io.discard(t));
        }
        *self = Table::Unloaded;
    }
}

/// Every block's attention projections: resident, or streamed.
enum Layers {
    Resident(Vec<Attention>),
    Streamed(Box<AttentionStream>),
    /// Neither: a budget change failed to read them again.
    Unloaded,
}

impl Layers {
    fn open(io: &mut Reader, layers: &[[Extent; 4]], streamed: bool) -> Result<Self> {
        if streamed {
            // One layer's four projections.
            let layer_bytes = layers
                .iter()
                .map(|l| l.iter().map(|e| e.len).sum::<usize>())
                .max()
                .unwrap_or(0);
            let mut stream = AttentionStream {
                layers: layers.to_vec(),
                current: None,
                ahead: VecDeque::new(),
                spares: SpareBuffers::new(layer_bytes),
            };
            // The next token's reads start now, as every later token's start during the one
            // before.
            stream.queue_ahead(io, 0);
            return Ok(Layers::Streamed(Box::new(stream)));
        }
        let layers = layers
            .iter()
            .map(|[q, k, v, o]| {
                Ok(Attention {
                    wq: resident(io, q)?,
                    wk: resident(io, k)?,
                    wv: resident(io, v)?,
                    wo: resident(io, o)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(Layers::Resident(layers))
    }

    /// Drops the projections, withdrawing the reads ahead.
    fn unload(&mut self, io: &Reader) {
        if let Layers::Streamed(s) = self {
            s.ahead
                .drain(..)
                .flat_map(|(_, t)| t)
                .for_each(|t| io.discard(t));
        }
        *self = Layers::Unloaded;
    }
}

/// Where the dense tensors are in the file.
struct Extents {
    attention: Vec<[Extent; 4]>,
    embedding: Extent,
    /// `None`: tied to the embedding.
    head: Option<Extent>,
}

/// The dense weights of a streaming model, as [`DenseWeights`] for its forward passes.
pub struct DenseStream {
    io: Reader,
    extents: Extents,
    streamed: DenseStreamed,
    attention: Layers,
    /// The attention projections are computed elsewhere (the GPU): not held, not read.
    away: bool,
    embed: Table,
    /// `None`: tied to the embedding.
    head: Option<Table>,
}

/// What a forward pass finds where a failed budget change left a part unloaded.
fn unloaded() -> anyhow::Error {
    anyhow::anyhow!("the dense weights could not be read again after a budget change")
}

impl DenseStream {
    /// Loads the resident dense weights of `t`'s file and prepares to stream the others, which
    /// for the embedding and head means reading and checking them once now.
    pub fn open(
        t: &DenseTensors,
        c: &ModelConfig,
        streamed: DenseStreamed,
        queue: Arc<IoQueue>,
    ) -> Result<Self> {
        let extents = Extents {
            attention: t.attention_extents(c)?,
            embedding: t.embedding(c)?,
            head: t.head(c)?,
        };
        let mut stream = Self {
            io: Reader {
                queue,
                bytes: 0,
                reads: 0,
            },
            extents,
            streamed,
            attention: Layers::Unloaded,
            away: false,
            embed: Table::Unloaded,
            head: None,
        };
        stream.load(DenseStreamed::default(), true)?;
        Ok(stream)
    }

    /// Moves dense weights between resident and streamed (a new budget, between tokens): each
    /// part that changes is dropped first — its memory freed, its reads in flight withdrawn —
    /// then read again as resident (whole, checked) or opened as a stream. Output is unchanged:
    /// both compute on the same encoded bytes. After an error (a read that failed) the parts not
    /// read again make the next forward pass fail with an error, never with other results.
    pub fn set_streamed(&mut self, to: DenseStreamed) -> Result<()> {
        let from = std::mem::replace(&mut self.streamed, to);
        self.load(from, false)
    }

    /// (Re)loads the parts whose placement differs from `from`'s (every part when `all`).
    fn load(&mut self, from: DenseStreamed, all: bool) -> Result<()> {
        let to = self.streamed;
        let io = &mut self.io;
        let e = &self.extents;
        let tied = e.head.is_none();
        // A tied head is the embedding: it moves with it.
        let head_moves = all || from.head != to.head;
        let embed_moves = all || from.embedding != to.embedding;
        if all || from.attention != to.attention {
            self.attention.unload(io);
            if !self.away {
                self.attention = Layers::open(io, &e.attention, to.attention)?;
            }
        }
        if let (Some(h), true) = (&mut self.head, head_moves) {
            h.unload(io);
        }
        if embed_moves {
            self.embed.unload(io);
            self.embed = Table::open(io, &e.embedding, to.embedding)?;
        }
        if let (Some(h), true) = (&e.head, head_moves) {
            self.head = Some(Table::open(io, h, to.head)?);
        }
        // The next token's first head blocks, queued now as every later token's are during the
        // one before.
        if head_moves || (tied && embed_moves) {
            if let Some(Table::Streamed(s)) = self.head.as_mut().or(Some(&mut self.embed)) {
                s.queue_blocks(io);
            }
        }
        Ok(())
    }

    /// Drops the attention projections (their memory freed, their reads withdrawn): another
    /// device computes them, the GPU's half of each step. Until
    /// [`attention_back`](Self::attention_back) a forward pass that asks for them is an error, and
    /// budget changes neither read nor stream them.
    #[cfg(feature = "gpu")]
    pub fn attention_away(&mut self) {
        self.away = true;
        self.attention.unload(&self.io);
    }

    /// Holds the attention projections again, resident or streamed as the placement says.
    #[cfg(feature = "gpu")]
    pub fn attention_back(&mut self) -> Result<()> {
        self.away = false;
        let e = &self.extents;
        self.attention = Layers::open(&mut self.io, &e.attention, self.streamed.attention)?;
        Ok(())
    }

    /// The attention projections and the output head, where both are resident (for the GPU).
    #[cfg(feature = "gpu")]
    pub fn resident(&self) -> Option<(&[Attention], &Weight)> {
        let attention = match &self.attention {
            Layers::Resident(layers) => layers.as_slice(),
            _ => return None,
        };
        match self.head.as_ref().unwrap_or(&self.embed) {
            Table::Resident(head) => Some((attention, head)),
            _ => None,
        }
    }

    /// Bytes and reads of dense weights submitted so far.
    pub fn counters(&self) -> (u64, u64) {
        (self.io.bytes, self.io.reads)
    }
}

impl DenseWeights for DenseStream {
    fn embed(&mut self, tokens: &[u32], out: &mut [f32]) -> Result<()> {
        match &mut self.embed {
            Table::Resident(w) => w.rows_f32(tokens, out),
            Table::Streamed(s) => s.embed(&mut self.io, tokens, out)?,
            Table::Unloaded => return Err(unloaded()),
        }
        Ok(())
    }

    fn attention(&mut self, l: usize) -> Result<&Attention> {
        if self.away {
            bail!("the attention projections are on the GPU, not in this process's memory");
        }
        match &mut self.attention {
            Layers::Streamed(stream) => stream.get(&mut self.io, l),
            Layers::Resident(layers) => Ok(&layers[l]),
            Layers::Unloaded => Err(unloaded()),
        }
    }

    fn head(&mut self, xn: &[f32], rows: usize, logits: &mut [f32]) -> Result<()> {
        match self.head.as_mut().unwrap_or(&mut self.embed) {
            Table::Resident(w) => w.matmul_t(xn, rows, logits),
            Table::Streamed(s) => s.head(&mut self.io, xn, rows, logits)?,
            Table::Unloaded => return Err(unloaded()),
        }
        Ok(())
    }

    fn head_rows_bitwise(&self) -> bool {
        match self.head.as_ref().unwrap_or(&self.embed) {
            Table::Resident(w) => w.qtype().is_block(),
            Table::Streamed(s) => s.e.qtype.is_block(),
            Table::Unloaded => false,
        }
    }
}
