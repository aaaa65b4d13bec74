use crate::value::{min_encoded_len, TYPE_ARRAY};
use crate::{align_up, GgufError, MetaValue, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use memmap2::{Mmap, MmapMut};
use std::collections::HashMap;
use std::fmt;
use std::fs::File;
use std::ops::Range;
use std::path::Path;
use std::sync::Arc;
use turbo_core::dtype::ggml_type_name;
use turbo_core::{Bytes, DType, WeightMatrix};

type Result<T, E = GgufError> = std::result::Result<T, E>;

/// Nested arrays deeper than this are treated as corruption: the reader recurses per level, and
/// a file of nothing but array headers must not overflow the stack. Real files nest at most once.
const MAX_ARRAY_DEPTH: usize = 8;

/// Fewest bytes of one tensor directory entry (empty name, no dims): bounds the tensor count.
const MIN_TENSOR_INFO_LEN: usize = 8 + 4 + 4 + 8;

/// Characters of an invalid string shown in its error message.
const MAX_PREVIEW_CHARS: usize = 64;

/// Fewest bytes of one metadata entry (empty key, one-byte value): bounds the entry count.
const MIN_KV_LEN: usize = 8 + 4 + 1;

/// One entry of the tensor directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous (column) dimension.
    pub dims: Vec<u64>,
    pub ggml_type: u32,
    /// Relative to the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// `None` for ggml types Turbo cannot compute with (k-quants, i-quants, ...).
    pub fn dtype(&self) -> Option<DType> {
        DType::from_ggml_id(self.ggml_type)
    }

    /// Saturates instead of overflowing; the directory of an opened file never overflows.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1, |n, &d| n.saturating_mul(d))
    }

    fn type_name(&self) -> String {
        match ggml_type_name(self.ggml_type) {
            "?" => format!("unknown ggml type {}", self.ggml_type),
            name => name.to_owned(),
        }
    }

    /// Bytes of the tensor's data; `Ok(None)` for types whose block layout Turbo does not know.
    pub(crate) fn data_len(&self) -> Result<Option<u64>> {
        let bad = |reason: String| GgufError::BadShape {
            tensor: self.name.clone(),
            reason,
        };
        if self.dims.len() > MAX_DIMS {
            return Err(bad(format!(
                "{} dimensions, more than ggml's {MAX_DIMS}",
                self.dims.len()
            )));
        }
        let n = self
            .dims
            .iter()
            .try_fold(1u64, |n, &d| n.checked_mul(d))
            .ok_or_else(|| bad(format!("dimensions {:?} overflow", self.dims)))?;
        let Some(dtype) = self.dtype() else {
            return Ok(None);
        };
        let (block_len, block_bytes) = (dtype.block_len() as u64, dtype.block_bytes() as u64);
        let cols = self.dims.first().copied().unwrap_or(1);
        if cols % block_len != 0 {
            return Err(bad(format!(
                "rows of {cols} elements are not a whole number of {dtype} blocks of {block_len}"
            )));
        }
        (n / block_len)
            .checked_mul(block_bytes)
            .map(Some)
            .ok_or_else(|| bad(format!("dimensions {:?} overflow", self.dims)))
    }
}

/// A parsed GGUF file whose tensor data stays memory-mapped.
pub struct GgufFile {
    map: Arc<Mmap>,
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    meta_index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    alignment: u32,
    data_start: u64,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Metadata holds whole vocabularies; listing it would drown any log.
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("bytes", &self.map.len())
            .finish()
    }
}

impl GgufFile {
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let io = |error| GgufError::Io {
            path: path.to_owned(),
            error,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only. Like every mmap-based model loader, we rely on nobody
        // truncating or rewriting the model file while it is loaded.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(Arc::new(map))
    }

    /// Parses an in-memory file; its bytes are copied into an anonymous map so that tensor data
    /// is served exactly as for [`GgufFile::open`].
    pub fn from_bytes(bytes: Vec<u8>) -> Result<Self> {
        let io = |error| GgufError::Io {
            path: "<memory>".into(),
            error,
        };
        let mut map = MmapMut::map_anon(bytes.len()).map_err(io)?;
        map.copy_from_slice(&bytes);
        Self::parse(Arc::new(map.make_read_only().map_err(io)?))
    }

    fn parse(map: Arc<Mmap>) -> Result<Self> {
        let mut cur = Cursor { buf: &map, pos: 0 };
        let found = cur.array("magic")?;
        if &found != MAGIC {
            return Err(GgufError::BadMagic { found });
        }
        let version = cur.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        let n_tensors = cur.count(MIN_TENSOR_INFO_LEN, "tensor count")?;
        let n_kv = cur.count(MIN_KV_LEN, "metadata entry count")?;

        let mut metadata = Vec::with_capacity(n_kv);
        let mut meta_index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            let key = cur
                .string("key")
                .map_err(|e| e.within(&format!("metadata entry #{i}")))?;
            let value = cur
                .u32("value type")
                .and_then(|ty| cur.value(ty, 0))
                .map_err(|e| e.within(&format!("metadata key '{key}'")))?;
            if meta_index.insert(key.clone(), metadata.len()).is_some() {
                return Err(GgufError::Corrupt(format!(
                    "duplicate metadata key '{key}'"
                )));
            }
            metadata.push((key, value));
        }

        let alignment = match meta_index.get(ALIGNMENT_KEY).map(|&i| &metadata[i].1) {
            None => DEFAULT_ALIGNMENT,
            Some(MetaValue::U32(a)) if a.is_power_of_two() => *a,
            Some(v) => {
                return Err(GgufError::Corrupt(format!(
                    "{ALIGNMENT_KEY} must be a power-of-two u32, found {}",
                    v.as_u64()
                        .map_or_else(|| v.describe(), |n| format!("{} {n}", v.type_name()))
                )))
            }
        };

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info = cur
                .tensor_info()
                .map_err(|e| e.within(&format!("tensor directory entry #{i}")))?;
            if tensor_index.insert(info.name.clone(), i).is_some() {
                return Err(GgufError::Corrupt(format!(
                    "duplicate tensor '{}'",
                    info.name
                )));
            }
            tensors.push(info);
        }

        let data_start = align_up(cur.pos as u64, alignment.into())
            .ok_or_else(|| GgufError::Corrupt("data section start overflows".into()))?;
        let file = GgufFile {
            map,
            version,
            metadata,
            meta_index,
            tensors,
            tensor_index,
            alignment,
            data_start,
        };
        for info in &file.tensors {
            file.validate(info)?;
        }
        file.check_disjoint()?;
        Ok(file)
    }

    /// Rejects tensors whose data overlap: two weights would alias the same bytes, which no
    /// converter writes (llama.cpp lays tensors out one after the other and refuses anything
    /// else) and which only a corrupt or crafted file holds. The directory's order is not
    /// required, only that every byte belongs to at most one tensor.
    ///
    /// A tensor of a type whose block layout Turbo does not know has an unknown length; it is
    /// taken to hold at least its first byte, so it may not start inside another tensor or at
    /// another's offset. Tensors of no elements hold no bytes and overlap nothing.
    fn check_disjoint(&self) -> Result<()> {
        let mut spans: Vec<(u64, u64, &TensorInfo)> = Vec::with_capacity(self.tensors.len());
        for info in &self.tensors {
            let len = match info.data_len()? {
                Some(len) => len,
                None if info.n_elements() > 0 => 1,
                None => 0,
            };
            if len > 0 {
                // `validate` checked that the end fits in the file.
                spans.push((info.offset, info.offset + len, info));
            }
        }
        spans.sort_unstable_by_key(|&(start, end, _)| (start, end));
        let mut reach: Option<(u64, u64, &TensorInfo)> = None;
        for span in spans {
            if let Some(prev) = reach.filter(|prev| span.0 < prev.1) {
                return Err(GgufError::Corrupt(format!(
                    "tensors '{}' (data bytes {}..{}) and '{}' (data bytes {}..{}) overlap",
                    prev.2.name, prev.0, prev.1, span.2.name, span.0, span.1
                )));
            }
            reach = Some(span);
        }
        Ok(())
    }

    fn validate(&self, info: &TensorInfo) -> Result<()> {
        if !info.offset.is_multiple_of(u64::from(self.alignment)) {
            return Err(GgufError::Corrupt(format!(
                "tensor '{}' has offset {}, not a multiple of the alignment {}",
                info.name, info.offset, self.alignment
            )));
        }
        let len = info.data_len().map_err(|e| match e {
            GgufError::BadShape { tensor, reason } => {
                GgufError::Corrupt(format!("tensor '{tensor}': {reason}"))
            }
            e => e,
        })?;
        self.data_range(info, len.unwrap_or(0)).map(drop)
    }

    /// Where a tensor's `len` bytes lie in the file, checked against its end.
    fn data_range(&self, info: &TensorInfo, len: u64) -> Result<Range<usize>> {
        let start = self.data_start.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(start), Some(end)) if end <= self.map.len() as u64 => {
                Ok(start as usize..end as usize)
            }
            _ => Err(GgufError::Corrupt(format!(
                "tensor '{}' data ({len} bytes at data offset {}) lies past the end of the \
                 {}-byte file; is the file truncated?",
                info.name,
                info.offset,
                self.map.len()
            ))),
        }
    }

    pub fn version(&self) -> u32 {
        self.version
    }

    /// The data section's alignment (`general.alignment`, default 32).
    pub fn alignment(&self) -> u32 {
        self.alignment
    }

    /// File offset of the data section, to which [`TensorInfo::offset`] is relative.
    pub fn data_offset(&self) -> u64 {
        self.data_start
    }

    /// In file order, which converters preserve and tools display.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn typed<'a, T>(
        &'a self,
        key: &str,
        expected: &'static str,
        convert: impl FnOnce(&'a MetaValue) -> Option<T>,
    ) -> Result<T> {
        let value = self
            .get(key)
            .ok_or_else(|| GgufError::MissingKey(key.to_owned()))?;
        convert(value).ok_or_else(|| GgufError::WrongType {
            key: key.to_owned(),
            expected,
            found: value.describe(),
        })
    }

    pub fn get_u32(&self, key: &str) -> Result<u32> {
        self.typed(key, "an integer that fits in u32", |v| {
            v.as_u64().and_then(|n| n.try_into().ok())
        })
    }

    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "a non-negative integer", MetaValue::as_u64)
    }

    pub fn get_f32(&self, key: &str) -> Result<f32> {
        self.typed(key, "f32 or f64", MetaValue::as_f32)
    }

    pub fn get_str(&self, key: &str) -> Result<&str> {
        self.typed(key, "string", MetaValue::as_str)
    }

    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "bool", MetaValue::as_bool)
    }

    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.typed(key, "array of string", |v| {
            v.as_array()?.iter().map(MetaValue::as_str).collect()
        })
    }

    pub fn get_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.typed(key, "array of integers that fit in i32", |v| {
            v.as_array()?
                .iter()
                .map(|x| x.as_i64().and_then(|n| n.try_into().ok()))
                .collect()
        })
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.typed(key, "array of f32 or f64", |v| {
            v.as_array()?.iter().map(MetaValue::as_f32).collect()
        })
    }

    pub fn architecture(&self) -> Result<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's data as a window of the map (no copy). `info` may come from elsewhere; it is
    /// checked against this file again.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<Bytes> {
        let len = info
            .data_len()?
            .ok_or_else(|| GgufError::UnsupportedTensorType {
                tensor: info.name.clone(),
                type_name: info.type_name(),
            })?;
        Ok(Bytes::mapped(self.map.clone(), self.data_range(info, len)?))
    }

    /// A 1-D (`[cols]`, one row) or 2-D (`[cols, rows]` in ggml order) tensor as a matrix.
    pub fn matrix(&self, name: &str) -> Result<WeightMatrix> {
        let info = self
            .tensor(name)
            .ok_or_else(|| GgufError::MissingTensor(name.to_owned()))?;
        let dtype = info
            .dtype()
            .ok_or_else(|| GgufError::UnsupportedTensorType {
                tensor: info.name.clone(),
                type_name: info.type_name(),
            })?;
        let bad = |reason: String| GgufError::BadShape {
            tensor: info.name.clone(),
            reason,
        };
        let (rows, cols) = match info.dims[..] {
            [cols] => (1, cols),
            [cols, rows] => (rows, cols),
            _ => {
                return Err(bad(format!(
                    "a matrix needs 1 or 2 dimensions, found {:?}",
                    info.dims
                )))
            }
        };
        let to_usize = |n: u64| usize::try_from(n).map_err(|_| bad(format!("{n} is too large")));
        let (rows, cols) = (to_usize(rows)?, to_usize(cols)?);
        WeightMatrix::new(dtype, rows, cols, self.tensor_bytes(info)?).map_err(bad)
    }
}

/// Bounds-checked little-endian reads over the file's bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

macro_rules! le_readers {
    ($($name:ident: $t:ty),*) => {
        $(fn $name(&mut self, what: &str) -> Result<$t> {
            Ok(<$t>::from_le_bytes(self.array(what)?))
        })*
    };
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let bytes = self.buf[self.pos..]
            .get(..n)
            .ok_or_else(|| GgufError::Truncated {
                what: what.to_owned(),
                offset: self.pos as u64,
            })?;
        self.pos += n;
        Ok(bytes)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut out = [0; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    le_readers!(u8: u8, i8: i8, u16: u16, i16: i16, u32: u32, i32: i32, f32: f32,
                u64: u64, i64: i64, f64: f64);

    /// Reads a count of items that take at least `item_len` bytes each, rejecting any count the
    /// rest of the file cannot hold, so that callers may allocate for it.
    fn count(&mut self, item_len: usize, what: &str) -> Result<usize> {
        let at = self.pos;
        let n = self.u64(what)?;
        let left = self.buf.len() - self.pos;
        match usize::try_from(n) {
            Ok(n) if n <= left / item_len => Ok(n),
            _ => Err(GgufError::Corrupt(format!(
                "{what} {n} at offset {at} is more than the remaining {left} bytes can hold \
                 (corrupt or truncated file)"
            ))),
        }
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos;
        let len = self.u64(what)?;
        let bytes = usize::try_from(len)
            .ok()
            .and_then(|n| self.buf[self.pos..].get(..n))
            .ok_or_else(|| GgufError::Truncated {
                what: what.to_owned(),
                offset: at as u64,
            })?;
        self.pos += bytes.len();
        std::str::from_utf8(bytes).map(str::to_owned).map_err(|e| {
            // Shown decoded lossily (and escaped by the error's Display), never as raw bytes;
            // only its start, however long the string claims to be.
            let head = &bytes[..bytes.len().min(4 * MAX_PREVIEW_CHARS)];
            let text = String::from_utf8_lossy(head);
            let preview: String = text.chars().take(MAX_PREVIEW_CHARS).collect();
            let cut = head.len() < bytes.len() || text.chars().nth(MAX_PREVIEW_CHARS).is_some();
            let more = if cut { "..." } else { "" };
            GgufError::Corrupt(format!(
                "{what} at offset {at} is not UTF-8 ({e}): '{preview}{more}'"
            ))
        })
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.u8("u8 value")?),
            1 => MetaValue::I8(self.i8("i8 value")?),
            2 => MetaValue::U16(self.u16("u16 value")?),
            3 => MetaValue::I16(self.i16("i16 value")?),
            4 => MetaValue::U32(self.u32("u32 value")?),
            5 => MetaValue::I32(self.i32("i32 value")?),
            6 => MetaValue::F32(self.f32("f32 value")?),
            7 => match self.u8("bool value")? {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => {
                    return Err(GgufError::Corrupt(format!(
                        "bool value {b} at offset {}",
                        self.pos - 1
                    )))
                }
            },
            8 => MetaValue::String(self.string("string value")?),
            TYPE_ARRAY => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(GgufError::Corrupt(format!(
                        "arrays nested more than {MAX_ARRAY_DEPTH} deep at offset {}",
                        self.pos
                    )));
                }
                let elem = self.u32("array element type")?;
                let min_len = min_encoded_len(elem).ok_or_else(|| unknown_type(elem))?;
                let n = self.count(min_len, "array length")?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                MetaValue::Array(items)
            }
            10 => MetaValue::U64(self.u64("u64 value")?),
            11 => MetaValue::I64(self.i64("i64 value")?),
            12 => MetaValue::F64(self.f64("f64 value")?),
            _ => return Err(unknown_type(ty)),
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo> {
        let name = self.string("tensor name")?;
        let at = self.pos;
        let n_dims = self.u32("dimension count")? as usize;
        if n_dims > MAX_DIMS {
            return Err(GgufError::Corrupt(format!(
                "tensor '{name}' has {n_dims} dimensions at offset {at}, more than ggml's {MAX_DIMS}"
            )));
        }
        let dims = (0..n_dims)
            .map(|_| self.u64("dimension"))
            .collect::<Result<_>>()?;
        Ok(TensorInfo {
            name,
            dims,
            ggml_type: self.u32("tensor type")?,
            offset: self.u64("tensor offset")?,
        })
    }
}

fn unknown_type(ty: u32) -> GgufError {
    GgufError::Corrupt(format!("unknown metadata value type {ty}"))
}
