//! `response_format` by grammar-constrained sampling: an incremental JSON recognizer, byte by
//! byte, that a schema can narrow. Before each token is sampled, every token whose text cannot
//! continue valid JSON (or JSON of the schema) gets a logit of minus infinity; once the top-level
//! object is closed, only an end-of-sequence token may follow.
//!
//! `json_object`: any JSON object. `json_schema`: an object whose properties are strings,
//! numbers, integers, booleans, nulls, enums (or `const`), arrays and nested objects. An object
//! is written with its required properties in alphabetical order (JSON objects are unordered;
//! optional properties are left out, which the schema allows); anything else in a schema (`anyOf`, `$ref`,
//! `pattern`, `minimum`...) is refused with a 400 naming the keyword.

use serde_json::Value;

/// A compiled grammar: schema nodes in an arena, the root first.
#[derive(Debug)]
pub struct Grammar {
    nodes: Vec<Node>,
    any: usize,
    boolean: usize,
    null: usize,
}

#[derive(Debug)]
enum Node {
    /// Any JSON value.
    Any,
    /// Any JSON object.
    AnyObject,
    String,
    Number {
        integer: bool,
    },
    /// One of these JSON texts (an enum, `true`/`false`, `null`, an object key).
    Literals(Vec<Vec<u8>>),
    /// An array of items of the node.
    Array(usize),
    /// An object with these properties in this order: (key literal node, value node).
    Object(Vec<(usize, usize)>),
}

/// Where the recognizer is inside one value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// A value of the node comes next (whitespace first allowed).
    Value(usize),
    /// Inside a string: 0 plain, 1 after a backslash, 2..=5 hex digits of `\u` left plus one.
    Str(u8),
    /// A number: its state, whether it must be an integer, and the digits of the current part.
    Num(Num, bool, u8),
    /// Matching the node's literals: `pos` bytes read, equal to `lits[first][..pos]`.
    Lit { node: usize, first: u16, pos: u16 },
    /// Any object.
    AnyObj(ObjState),
    /// An object of the node, at property `index`.
    Obj {
        node: usize,
        index: u16,
        state: ObjState,
    },
    /// An array of `item`s.
    Arr { item: usize, state: ArrState },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ObjState {
    /// After `{`: a key or `}`.
    Open,
    /// After a key: `:`.
    AfterKey,
    /// After a value: `,` or `}`.
    AfterValue,
    /// After `,`: a key.
    AfterComma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ArrState {
    Open,
    AfterValue,
    AfterComma,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Num {
    Start,
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    E,
    ESign,
    Exp,
}

impl Num {
    fn complete(self) -> bool {
        matches!(self, Num::Zero | Num::Int | Num::Frac | Num::Exp)
    }

    fn next(self, b: u8, integer: bool) -> Option<Num> {
        let digit = b.is_ascii_digit();
        Some(match (self, b) {
            (Num::Start, b'-') => Num::Minus,
            (Num::Start | Num::Minus, b'0') => Num::Zero,
            (Num::Start | Num::Minus, _) if digit => Num::Int,
            (Num::Int, _) if digit => Num::Int,
            (Num::Zero | Num::Int, b'.') if !integer => Num::Dot,
            (Num::Zero | Num::Int | Num::Frac, b'e' | b'E') if !integer => Num::E,
            (Num::Dot | Num::Frac, _) if digit => Num::Frac,
            (Num::E, b'+' | b'-') => Num::ESign,
            (Num::E | Num::ESign | Num::Exp, _) if digit => Num::Exp,
            _ => return None,
        })
    }
}

/// What a frame made of a byte.
enum Step {
    Consumed,
    Rejected,
    /// The frame's value ended before this byte: pop it and give the byte to its parent.
    EndedBefore,
}

/// Consecutive whitespace bytes allowed between tokens of JSON (a model that only writes
/// whitespace would otherwise never finish).
const MAX_WHITESPACE_RUN: u8 = 12;

/// Digits of a number's integer or fraction part, and of its exponent: numbers stay within what
/// a 64-bit float or integer holds (1e999 is JSON, but no parser's number).
const MAX_DIGITS: u8 = 15;
const MAX_EXPONENT_DIGITS: u8 = 2;

/// The recognizer's state: a stack of frames.
#[derive(Debug, Clone, Default)]
pub struct Matcher {
    stack: Vec<Frame>,
    /// Whitespace bytes since the last other byte, and whether a line break is among them (one
    /// is allowed: indented JSON, but no blank lines).
    whitespace_run: u8,
    line_break: bool,
}

impl Grammar {
    /// `{"type": "json_object"}`: any object.
    pub fn json_object() -> Self {
        let mut g = Self::empty();
        g.nodes[0] = Node::AnyObject;
        g
    }

    /// A `json_schema`'s `schema`; the error names the unsupported part.
    pub fn from_schema(schema: &Value) -> Result<Self, String> {
        let mut g = Self::empty();
        if schema.get("type").and_then(Value::as_str) != Some("object") {
            return Err("the schema's top level must be {\"type\": \"object\", ...}".into());
        }
        let root = g.compile(schema, "schema")?;
        g.nodes.swap(0, root);
        // Node indices point at the old places: swap them in every reference.
        let fix = |i: usize| {
            if i == 0 {
                root
            } else if i == root {
                0
            } else {
                i
            }
        };
        for node in &mut g.nodes {
            match node {
                Node::Array(item) => *item = fix(*item),
                Node::Object(props) => {
                    for (k, v) in props.iter_mut() {
                        *k = fix(*k);
                        *v = fix(*v);
                    }
                }
                _ => {}
            }
        }
        Ok(g)
    }

    fn empty() -> Self {
        Self {
            nodes: vec![
                Node::Any,
                Node::Any,
                Node::Literals(vec![b"true".to_vec(), b"false".to_vec()]),
                Node::Literals(vec![b"null".to_vec()]),
            ],
            any: 1,
            boolean: 2,
            null: 3,
        }
    }

    fn push(&mut self, node: Node) -> usize {
        self.nodes.push(node);
        self.nodes.len() - 1
    }

    fn compile(&mut self, s: &Value, path: &str) -> Result<usize, String> {
        const KNOWN: [&str; 14] = [
            "type",
            "properties",
            "required",
            "items",
            "enum",
            "const",
            "additionalProperties",
            "title",
            "description",
            "default",
            "examples",
            "$schema",
            "strict",
            "name",
        ];
        let Value::Object(obj) = s else {
            return Err(format!("{path} must be a JSON object"));
        };
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(format!(
                "`{k}` at {path} is not supported: schemas may use type (object, array, string, \
                 number, integer, boolean, null), properties, required, items, enum and const"
            ));
        }
        let literal_values: Option<Vec<&Value>> = match (obj.get("enum"), obj.get("const")) {
            (Some(Value::Array(list)), _) if !list.is_empty() => Some(list.iter().collect()),
            (Some(_), _) => return Err(format!("{path}.enum must be a non-empty array")),
            (None, Some(v)) => Some(vec![v]),
            (None, None) => None,
        };
        if let Some(values) = literal_values {
            let lits = values
                .iter()
                .map(|v| serde_json::to_vec(v).expect("a JSON value serializes"))
                .collect();
            return Ok(self.push(Node::Literals(lits)));
        }
        let ty = match obj.get("type") {
            Some(Value::String(t)) => t.as_str(),
            None => return Ok(self.any),
            Some(other) => {
                return Err(format!(
                    "{path}.type is {other}: give one type as a string (a list of types is not \
                     supported)"
                ))
            }
        };
        Ok(match ty {
            "string" => self.push(Node::String),
            "number" => self.push(Node::Number { integer: false }),
            "integer" => self.push(Node::Number { integer: true }),
            "boolean" => self.boolean,
            "null" => self.null,
            "array" => {
                let item = match obj.get("items") {
                    None => self.any,
                    Some(items) => self.compile(items, &format!("{path}.items"))?,
                };
                self.push(Node::Array(item))
            }
            "object" => {
                let props = match obj.get("properties") {
                    None => return Ok(self.push(Node::AnyObject)),
                    Some(Value::Object(p)) => p,
                    Some(_) => return Err(format!("{path}.properties must be an object")),
                };
                let required: Vec<&str> = match obj.get("required") {
                    None => Vec::new(),
                    Some(Value::Array(r)) => r
                        .iter()
                        .map(|v| v.as_str())
                        .collect::<Option<_>>()
                        .ok_or_else(|| format!("{path}.required must be a list of names"))?,
                    Some(_) => return Err(format!("{path}.required must be a list of names")),
                };
                if let Some(missing) = required.iter().find(|r| !props.contains_key(**r)) {
                    return Err(format!(
                        "{path}.required names `{missing}`, which properties does not define"
                    ));
                }
                let mut list = Vec::new();
                for (name, sub) in props {
                    // Every property is checked; only the required ones are written.
                    let value = self.compile(sub, &format!("{path}.properties.{name}"))?;
                    if !required.contains(&name.as_str()) {
                        continue;
                    }
                    let key = serde_json::to_vec(&Value::String(name.clone()))
                        .expect("a string serializes");
                    let key = self.push(Node::Literals(vec![key]));
                    list.push((key, value));
                }
                self.push(Node::Object(list))
            }
            other => return Err(format!("{path}.type `{other}` is not a JSON type")),
        })
    }

    /// A recognizer at the start of the document.
    pub fn start(&self) -> Matcher {
        Matcher {
            stack: vec![Frame::Value(0)],
            whitespace_run: 0,
            line_break: false,
        }
    }

    fn literals(&self, node: usize) -> &[Vec<u8>] {
        match &self.nodes[node] {
            Node::Literals(l) => l,
            _ => unreachable!("a Lit frame points at a Literals node"),
        }
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\n' | b'\r' | b'\t')
}

impl Matcher {
    /// Whether the document is complete (its top-level value closed).
    pub fn is_complete(&self) -> bool {
        self.stack.is_empty()
    }

    /// Feeds `bytes`; `false` (and the state undefined) if they cannot continue the document.
    pub fn push_bytes(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.push(g, b))
    }

    /// Copies `other` into `self` without allocating once `self` has room.
    pub fn copy_from(&mut self, other: &Matcher) {
        self.stack.clone_from(&other.stack);
        self.whitespace_run = other.whitespace_run;
        self.line_break = other.line_break;
    }

    pub fn push(&mut self, g: &Grammar, b: u8) -> bool {
        let in_string = matches!(self.stack.last(), Some(Frame::Str(_)));
        if is_ws(b) && !in_string {
            let line_break = matches!(b, b'\n' | b'\r');
            if self.whitespace_run >= MAX_WHITESPACE_RUN || (line_break && self.line_break) {
                return false;
            }
            self.whitespace_run += 1;
            self.line_break |= line_break;
        } else {
            self.whitespace_run = 0;
            self.line_break = false;
        }
        loop {
            let Some(&top) = self.stack.last() else {
                return false;
            };
            match self.step(g, top, b) {
                Step::Consumed => return true,
                Step::Rejected => return false,
                Step::EndedBefore => {
                    self.stack.pop();
                }
            }
        }
    }

    fn set_top(&mut self, f: Frame) {
        *self.stack.last_mut().expect("a frame is on the stack") = f;
    }

    /// Begins a value of `node` with byte `b` in place of the top frame.
    fn begin_value(&mut self, g: &Grammar, node: usize, b: u8) -> Step {
        let f = match (&g.nodes[node], b) {
            (Node::Any | Node::AnyObject, b'{') => Frame::AnyObj(ObjState::Open),
            (Node::Any, b'[') => Frame::Arr {
                item: g.any,
                state: ArrState::Open,
            },
            (Node::Any | Node::String, b'"') => Frame::Str(0),
            (Node::Any, b'-' | b'0'..=b'9') => Frame::Num(Num::Start, false, 0),
            (Node::Number { integer }, b'-' | b'0'..=b'9') => Frame::Num(Num::Start, *integer, 0),
            (Node::Any, b't' | b'f') => Frame::Lit {
                node: g.boolean,
                first: 0,
                pos: 0,
            },
            (Node::Any, b'n') => Frame::Lit {
                node: g.null,
                first: 0,
                pos: 0,
            },
            (Node::Literals(_), _) => Frame::Lit {
                node,
                first: 0,
                pos: 0,
            },
            (Node::Array(item), b'[') => Frame::Arr {
                item: *item,
                state: ArrState::Open,
            },
            (Node::Object(_), b'{') => Frame::Obj {
                node,
                index: 0,
                state: ObjState::Open,
            },
            _ => return Step::Rejected,
        };
        self.set_top(f);
        match f {
            // These frames read their first byte themselves.
            Frame::Num(..) | Frame::Lit { .. } => self.step(g, f, b),
            _ => Step::Consumed,
        }
    }

    fn step(&mut self, g: &Grammar, top: Frame, b: u8) -> Step {
        match top {
            Frame::Value(node) => {
                if is_ws(b) {
                    Step::Consumed
                } else {
                    self.begin_value(g, node, b)
                }
            }
            Frame::Str(esc) => {
                let next = match (esc, b) {
                    (0, b'"') => {
                        self.stack.pop();
                        return Step::Consumed;
                    }
                    (0, b'\\') => 1,
                    (0, 0..=0x1f) => return Step::Rejected,
                    (0, _) => 0,
                    (1, b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => 0,
                    (1, b'u') => 5,
                    (2..=5, _) if b.is_ascii_hexdigit() => {
                        if esc == 2 {
                            0
                        } else {
                            esc - 1
                        }
                    }
                    _ => return Step::Rejected,
                };
                self.set_top(Frame::Str(next));
                Step::Consumed
            }
            Frame::Num(state, integer, digits) => match state.next(b, integer) {
                Some(next) => {
                    let digits = if b.is_ascii_digit() { digits + 1 } else { 0 };
                    let most = if matches!(next, Num::Exp) {
                        MAX_EXPONENT_DIGITS
                    } else {
                        MAX_DIGITS
                    };
                    if digits > most {
                        return Step::Rejected;
                    }
                    self.set_top(Frame::Num(next, integer, digits));
                    Step::Consumed
                }
                None if state.complete() => Step::EndedBefore,
                None => Step::Rejected,
            },
            Frame::Lit { node, first, pos } => {
                let lits = g.literals(node);
                let (first, pos) = (first as usize, pos as usize);
                let read = &lits[first][..pos];
                let candidates = || lits.iter().enumerate().filter(|(_, l)| l.starts_with(read));
                if let Some((i, _)) = candidates().find(|(_, l)| l.get(pos) == Some(&b)) {
                    let pos = pos + 1;
                    let now = &lits[i][..pos];
                    let longer = lits.iter().any(|l| l.len() > pos && l.starts_with(now));
                    if lits[i].len() == pos && !longer {
                        self.stack.pop();
                    } else {
                        self.set_top(Frame::Lit {
                            node,
                            first: i as u16,
                            pos: pos as u16,
                        });
                    }
                    Step::Consumed
                } else if pos > 0 && candidates().any(|(_, l)| l.len() == pos) {
                    Step::EndedBefore
                } else {
                    Step::Rejected
                }
            }
            Frame::AnyObj(state) => {
                if is_ws(b) {
                    return Step::Consumed;
                }
                match (state, b) {
                    (ObjState::Open, b'}') | (ObjState::AfterValue, b'}') => {
                        self.stack.pop();
                    }
                    (ObjState::Open | ObjState::AfterComma, b'"') => {
                        self.set_top(Frame::AnyObj(ObjState::AfterKey));
                        self.stack.push(Frame::Str(0));
                    }
                    (ObjState::AfterKey, b':') => {
                        self.set_top(Frame::AnyObj(ObjState::AfterValue));
                        self.stack.push(Frame::Value(g.any));
                    }
                    (ObjState::AfterValue, b',') => {
                        self.set_top(Frame::AnyObj(ObjState::AfterComma));
                    }
                    _ => return Step::Rejected,
                }
                Step::Consumed
            }
            Frame::Obj { node, index, state } => {
                if is_ws(b) {
                    return Step::Consumed;
                }
                let Node::Object(props) = &g.nodes[node] else {
                    unreachable!("an Obj frame points at an Object node")
                };
                let i = index as usize;
                let frame = |index: usize, state| Frame::Obj {
                    node,
                    index: index as u16,
                    state,
                };
                match (state, b) {
                    (ObjState::Open, b'}') if props.is_empty() => {
                        self.stack.pop();
                        Step::Consumed
                    }
                    (ObjState::AfterValue, b'}') if i + 1 == props.len() => {
                        self.stack.pop();
                        Step::Consumed
                    }
                    (ObjState::AfterValue, b',') if i + 1 < props.len() => {
                        self.set_top(frame(i + 1, ObjState::AfterComma));
                        Step::Consumed
                    }
                    (ObjState::Open | ObjState::AfterComma, _) if i < props.len() => {
                        self.set_top(frame(i, ObjState::AfterKey));
                        self.stack.push(Frame::Value(props[i].0));
                        let top = *self.stack.last().expect("just pushed");
                        self.step(g, top, b)
                    }
                    (ObjState::AfterKey, b':') => {
                        self.set_top(frame(i, ObjState::AfterValue));
                        self.stack.push(Frame::Value(props[i].1));
                        Step::Consumed
                    }
                    _ => Step::Rejected,
                }
            }
            Frame::Arr { item, state } => {
                if is_ws(b) {
                    return Step::Consumed;
                }
                let frame = |state| Frame::Arr { item, state };
                match (state, b) {
                    (ArrState::Open | ArrState::AfterValue, b']') => {
                        self.stack.pop();
                        Step::Consumed
                    }
                    (ArrState::AfterValue, b',') => {
                        self.set_top(frame(ArrState::AfterComma));
                        Step::Consumed
                    }
                    (ArrState::Open | ArrState::AfterComma, _) => {
                        self.set_top(frame(ArrState::AfterValue));
                        self.stack.push(Frame::Value(item));
                        let top = *self.stack.last().expect("just pushed");
                        self.step(g, top, b)
                    }
                    _ => Step::Rejected,
                }
            }
        }
    }
}

/// The text of every token of a vocabulary, as the grammar sees it, and the tokens with a text
/// in byte order, so that [`mask`] feeds a prefix shared by neighbours once.
pub struct TokenTexts {
    texts: Vec<Box<[u8]>>,
    /// The tokens with a text, sorted by it.
    order: Vec<u32>,
    /// `shared[i]`: the bytes `order[i]`'s text shares with `order[i - 1]`'s (0 for the first).
    shared: Vec<u32>,
    /// The tokens without a text.
    empty: Vec<u32>,
}

impl TokenTexts {
    /// Each token's text as it reads after another token (so a tokenizer that drops a word's
    /// leading space at the start of a text keeps it); special tokens have no text.
    pub fn new(tokenizer: &crate::tokenizer::Tokenizer, vocab: usize) -> anyhow::Result<Self> {
        let anchor = *tokenizer
            .encode("a", false)?
            .first()
            .ok_or_else(|| anyhow::anyhow!("the tokenizer gives no token for \"a\""))?;
        let base = tokenizer.decode(&[anchor])?;
        let texts = (0..vocab as u32)
            .map(|id| {
                let text = tokenizer.decode(&[anchor, id])?;
                Ok(text
                    .strip_prefix(base.as_str())
                    .unwrap_or("")
                    .as_bytes()
                    .into())
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Self::from_texts(texts))
    }

    fn from_texts(texts: Vec<Box<[u8]>>) -> Self {
        let mut order: Vec<u32> = (0..texts.len() as u32)
            .filter(|&id| !texts[id as usize].is_empty())
            .collect();
        order.sort_by(|&a, &b| texts[a as usize].cmp(&texts[b as usize]));
        let shared = std::iter::once(0)
            .chain(order.windows(2).map(|w| {
                let (a, b) = (&texts[w[0] as usize], &texts[w[1] as usize]);
                a.iter().zip(b.iter()).take_while(|(x, y)| x == y).count() as u32
            }))
            .take(order.len())
            .collect();
        let empty = (0..texts.len() as u32)
            .filter(|&id| texts[id as usize].is_empty())
            .collect();
        Self {
            texts,
            order,
            shared,
            empty,
        }
    }

    pub fn get(&self, token: u32) -> &[u8] {
        self.texts.get(token as usize).map_or(&[], |t| t)
    }
}

/// Sets to minus infinity the logit of every token that cannot continue `matcher`'s document;
/// `eos` tokens are allowed only once it is complete, and then nothing else is. The tokens are
/// taken in byte order, each fed from the state after the bytes it shares with the one before
/// (kept in `states`, one per byte of the text so far), and a prefix that is refused refuses every
/// token that begins with it unfed: the same answer as feeding every token's text whole, at a
/// fraction of the bytes. `states` is reused between calls. Returns how many tokens remain
/// allowed.
pub fn mask(
    g: &Grammar,
    matcher: &Matcher,
    texts: &TokenTexts,
    eos: &[u32],
    logits: &mut [f32],
    states: &mut Vec<Matcher>,
) -> usize {
    let complete = matcher.is_complete();
    let mut allowed = 0;
    if complete {
        for (id, logit) in logits.iter_mut().enumerate() {
            if eos.contains(&(id as u32)) {
                allowed += 1;
            } else {
                *logit = f32::NEG_INFINITY;
            }
        }
        return allowed;
    }
    if states.is_empty() {
        states.push(Matcher::default());
    }
    states[0].copy_from(matcher);
    // The bytes of the previous text whose states are in `states[1..=fed]`, and the length of
    // its prefix that was refused (none: `usize::MAX`).
    let (mut fed, mut refused) = (0usize, usize::MAX);
    for (&id, &shared) in texts.order.iter().zip(&texts.shared) {
        let shared = shared as usize;
        if refused > shared {
            // Not a continuation of the refused prefix: fed from what it shares with the last.
            refused = usize::MAX;
            let text = texts.get(id);
            let mut depth = shared.min(fed);
            while depth < text.len() {
                if states.len() <= depth + 1 {
                    states.push(Matcher::default());
                }
                let (done, next) = states.split_at_mut(depth + 1);
                next[0].copy_from(&done[depth]);
                if !next[0].push(g, text[depth]) {
                    refused = depth + 1;
                    break;
                }
                depth += 1;
            }
            fed = depth;
        }
        match logits.get_mut(id as usize) {
            Some(logit) if refused != usize::MAX || eos.contains(&id) => *logit = f32::NEG_INFINITY,
            Some(_) => allowed += 1,
            None => {}
        }
    }
    // Tokens without a text (special tokens, eos among them) cannot continue a document.
    for &id in &texts.empty {
        if let Some(logit) = logits.get_mut(id as usize) {
            *logit = f32::NEG_INFINITY;
        }
    }
    if let Some(beyond) = logits.get_mut(texts.texts.len()..) {
        beyond.fill(f32::NEG_INFINITY);
    }
    allowed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn accepts(g: &Grammar, text: &str) -> (bool, bool) {
        let mut m = g.start();
        let ok = m.push_bytes(g, text.as_bytes());
        (ok, ok && m.is_complete())
    }

    #[test]
    fn json_object_accepts_objects_and_their_prefixes_only() {
        let g = Grammar::json_object();
        for text in [
            r#"{}"#,
            r#" { "a" : [1, -2.5e+3, 0, true, false, null, "x\"\u00e9\n"], "b": {"c": {}} }"#,
            r#"{"k": "naïve ✓"}"#,
        ] {
            assert_eq!(accepts(&g, text), (true, true), "{text}");
            serde_json::from_str::<Value>(text).unwrap();
        }
        for prefix in [r#"{"a": [1, 2"#, r#"{"a"#, r#"{"a": tr"#, r#"{"a": -"#] {
            assert_eq!(accepts(&g, prefix), (true, false), "{prefix}");
        }
        for bad in [
            r#"[1]"#,
            r#""x""#,
            r#"{"a" 1}"#,
            r#"{"a": 01}"#,
            r#"{"a": 1.}"#,
            r#"{"a": tru }"#,
            r#"{"a": [1,]}"#,
            r#"{,}"#,
            "{\"a\": \"\u{1}\"}",
            r#"{"a": "\x"}"#,
            r#"{} x"#,
            r#"{"a": 1}}"#,
        ] {
            assert!(!accepts(&g, bad).0, "{bad}");
        }
        // Whitespace is bounded, one line break at a time; numbers fit a double.
        assert!(!accepts(&g, &format!("{{{}", " ".repeat(13))).0);
        assert!(accepts(&g, "{\n    \"a\": 1\n}").0);
        assert!(!accepts(&g, "{\n\n").0);
        assert!(accepts(&g, r#"{"a": -123456789012345.123456789012345e-99}"#).1);
        assert!(!accepts(&g, r#"{"a": 1e100"#).0);
        assert!(!accepts(&g, r#"{"a": 1234567890123456"#).0);
    }

    #[test]
    fn a_schema_fixes_keys_types_and_enums() {
        let schema = json!({
            "type": "object",
            "properties": {
                "name": {"type": "string"},
                "age": {"type": "integer"},
                "score": {"type": "number"},
                "ok": {"type": "boolean"},
                "color": {"enum": ["red", "green", 12, 123]},
                "tags": {"type": "array", "items": {"type": "string"}},
                "pos": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
                "note": {"type": "string"}
            },
            "required": ["name", "age", "score", "ok", "color", "tags", "pos"],
            "additionalProperties": false
        });
        let g = Grammar::from_schema(&schema).unwrap();
        // Required properties in alphabetical order: age, color, name, ok, pos, score, tags.
        let good = r#"{"age": -3, "color": 12, "name": "Ann", "ok": true, "pos": {"x": 0.25},
    "score": 1.5e2, "tags": ["a", "b"]}"#;
        assert_eq!(accepts(&g, good), (true, true));
        let good2 =
            r#"{"age":0,"color":123,"name":"","ok":false,"pos":{"x":-1},"score":7,"tags":[]}"#;
        assert_eq!(accepts(&g, good2), (true, true));
        let good3 =
            r#"{"age":0,"color":"green","name":"","ok":false,"pos":{"x":-1},"score":7,"tags":[]}"#;
        assert_eq!(accepts(&g, good3), (true, true));
        for bad in [
            r#"{"name": "a""#,
            r#"{"age": "5""#,
            r#"{"age": 1.5"#,
            r#"{"age": 1, "color": "blue""#,
            r#"{"age": 1, "color": 1234"#,
            r#"{"age": 1, "color": 12, "name": "a", "ok": 1"#,
            r#"{"age":0,"color":123,"name":"","ok":false,"pos":{"x":-1},"score":7,"tags":[1"#,
            r#"{"age":0,"color":123,"name":"","ok":false,"pos":{"x":-1},"score":7,"tags":[],"note":""}"#,
            r#"{"age":0,"color":123,"name":"","ok":false,"pos":{},"score":7,"tags":[]}"#,
        ] {
            assert!(!accepts(&g, bad).0, "{bad}");
        }
    }

    #[test]
    fn unsupported_schemas_are_refused_by_name() {
        for (schema, word) in [
            (json!({"type": "array"}), "top level"),
            (
                json!({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}),
                "anyOf",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": "string", "pattern": "x"}}}),
                "pattern",
            ),
            (
                json!({"type": "object", "properties": {"a": {"type": ["string", "null"]}}}),
                "a list of types",
            ),
            (
                json!({"type": "object", "properties": {}, "required": ["b"]}),
                "`b`",
            ),
        ] {
            let e = Grammar::from_schema(&schema).unwrap_err();
            assert!(e.contains(word), "{schema}: {e}");
        }
    }

    #[test]
    fn masking_keeps_only_continuations() {
        // A toy vocabulary: token i's text.
        let texts = TokenTexts::from_texts(
            ["{", "}", "\"a\"", ":", " 1", "x", "", "{\"", "a\":", "1}"]
                .iter()
                .map(|t| t.as_bytes().into())
                .collect(),
        );
        let g = Grammar::json_object();
        let eos = [6];
        let mut m = g.start();
        let mut scratch = Vec::new();
        let mut logits = vec![0.0; 10];
        assert_eq!(mask(&g, &m, &texts, &eos, &mut logits, &mut scratch), 2);
        let allowed: Vec<usize> = (0..10).filter(|&i| logits[i] == 0.0).collect();
        assert_eq!(allowed, [0, 7]);
        assert!(m.push_bytes(&g, b"{\"a\":"));
        let mut logits = vec![0.0; 10];
        mask(&g, &m, &texts, &eos, &mut logits, &mut scratch);
        let allowed: Vec<usize> = (0..10).filter(|&i| logits[i] == 0.0).collect();
        assert_eq!(allowed, [0, 2, 4, 7, 9]);
        assert!(m.push_bytes(&g, b"1}"));
        let mut logits = vec![0.0; 10];
        assert_eq!(mask(&g, &m, &texts, &eos, &mut logits, &mut scratch), 1);
        assert_eq!(logits[6], 0.0);
    }

    /// Feeding every token's text whole: what [`mask`] must answer.
    fn mask_by_each_token(g: &Grammar, m: &Matcher, texts: &TokenTexts, eos: &[u32]) -> Vec<bool> {
        (0..texts.texts.len() as u32)
            .map(|id| {
                if eos.contains(&id) {
                    return m.is_complete();
                }
                let text = texts.get(id);
                let mut trial = m.clone();
                !m.is_complete() && !text.is_empty() && trial.push_bytes(g, text)
            })
            .collect()
    }

    #[test]
    fn masking_in_byte_order_equals_feeding_every_token() {
        // A vocabulary of JSON-ish pieces (many sharing prefixes, some empty), from a fixed seed.
        let alphabet = b"{}[]\":, a1-.e\ntrufls";
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % n as u64) as usize
        };
        let texts: Vec<Box<[u8]>> = (0..3000)
            .map(|_| {
                let len = next(5);
                (0..len).map(|_| alphabet[next(alphabet.len())]).collect()
            })
            .collect();
        let texts = TokenTexts::from_texts(texts);
        let eos = [7, 11];
        let schema = json!({"type": "object", "properties": {
            "a": {"type": "array", "items": {"type": "number"}},
            "b": {"type": "string"}, "c": {"type": "boolean"}},
            "required": ["a", "b", "c"]});
        let doc = br#"{"a": [1, -2.5e3, 17], "b": "x, y: {z}", "c": true}"#;
        for g in [
            Grammar::json_object(),
            Grammar::from_schema(&schema).unwrap(),
        ] {
            let mut m = g.start();
            let mut states = Vec::new();
            for end in 0..=doc.len() {
                if end > 0 {
                    assert!(m.push(&g, doc[end - 1]), "the document's byte {}", end - 1);
                }
                let want = mask_by_each_token(&g, &m, &texts, &eos);
                let mut logits = vec![0.0; want.len()];
                let allowed = mask(&g, &m, &texts, &eos, &mut logits, &mut states);
                let got: Vec<bool> = logits.iter().map(|&l| l == 0.0).collect();
                assert_eq!(
                    got,
                    want,
                    "after {:?}",
                    String::from_utf8_lossy(&doc[..end])
                );
                assert_eq!(allowed, want.iter().filter(|&&b| b).count());
            }
        }
    }
}
