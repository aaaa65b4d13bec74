use crate::value::encode_str;
use crate::{align_up, GgufError, MetaValue, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

/// Builds a GGUF file in memory and writes it laid out as llama.cpp does: tensor offsets relative
/// to the data section, the data section and every tensor aligned, zero padding in between.
///
/// The alignment is 32 unless a power-of-two u32 `general.alignment` is added. Anything else under
/// that key is written as given, so tests can produce files a reader must reject.
#[derive(Debug, Clone)]
pub struct GgufWriter {
    version: u32,
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<(TensorInfo, Vec<u8>)>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        GgufWriter::new(3)
    }
}

impl GgufWriter {
    /// Versions 2 and 3 share a little-endian layout, so `version` only sets the header field; any
    /// other value makes a file readers reject, which is what tests want it for.
    pub fn new(version: u32) -> Self {
        GgufWriter {
            version,
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Adds a key, or replaces its value in place so that converters can override copied metadata.
    ///
    /// # Panics
    /// If `value` contains an array whose elements differ in type, which GGUF cannot encode.
    pub fn add_meta(&mut self, key: impl Into<String>, value: impl Into<MetaValue>) -> &mut Self {
        let (key, value) = (key.into(), value.into());
        if let Some(items) = value.find_mixed_array() {
            panic!("metadata '{key}': GGUF arrays must be homogeneous, got {items:?}");
        }
        match self.metadata.iter_mut().find(|(k, _)| *k == key) {
            Some((_, old)) => *old = value,
            None => self.metadata.push((key, value)),
        }
        self
    }

    /// Adds a tensor with `dims` in ggml order (`dims[0]` contiguous). For types Turbo knows, `data`
    /// must be exactly the tensor's size; other ggml types are written unchecked.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ggml_type: u32,
        data: Vec<u8>,
    ) -> Result<&mut Self, GgufError> {
        let info = TensorInfo {
            name: name.into(),
            dims: dims.to_vec(),
            ggml_type,
            offset: 0,
        };
        if self.tensors.iter().any(|(t, _)| t.name == info.name) {
            return Err(GgufError::Corrupt(format!(
                "tensor '{}' added twice",
                info.name
            )));
        }
        if let Some(len) = info.data_len()? {
            if len != data.len() as u64 {
                return Err(GgufError::BadShape {
                    tensor: info.name,
                    reason: format!("{dims:?} needs {len} bytes, got {}", data.len()),
                });
            }
        }
        self.tensors.push((info, data));
        Ok(self)
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == ALIGNMENT_KEY) {
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() => (*a).into(),
            _ => DEFAULT_ALIGNMENT.into(),
        }
    }

    pub fn write_to(&self, out: &mut impl Write) -> io::Result<()> {
        let alignment = self.alignment();
        let pad = |n: u64| align_up(n, alignment).expect("file size overflows u64") - n;

        let mut header = Vec::new();
        header.extend(MAGIC);
        header.extend(self.version.to_le_bytes());
        header.extend((self.tensors.len() as u64).to_le_bytes());
        header.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            encode_str(key, &mut header);
            header.extend(value.type_id().to_le_bytes());
            value.encode(&mut header);
        }
        let mut offset = 0u64;
        for (info, data) in &self.tensors {
            encode_str(&info.name, &mut header);
            header.extend((info.dims.len() as u32).to_le_bytes());
            info.dims
                .iter()
                .for_each(|d| header.extend(d.to_le_bytes()));
            header.extend(info.ggml_type.to_le_bytes());
            header.extend(offset.to_le_bytes());
            offset += data.len() as u64;
            offset += pad(offset);
        }
        header.resize(header.len() + pad(header.len() as u64) as usize, 0);
        out.write_all(&header)?;

        let zeros = vec![0; alignment as usize];
        for (_, data) in &self.tensors {
            out.write_all(data)?;
            out.write_all(&zeros[..pad(data.len() as u64) as usize])?;
        }
        Ok(())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out)
            .expect("writing to a Vec cannot fail");
        out
    }

    pub fn write(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let io = |error| GgufError::Io {
            path: path.to_owned(),
            error,
        };
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        self.write_to(&mut out).map_err(io)?;
        out.flush().map_err(io)
    }
}
