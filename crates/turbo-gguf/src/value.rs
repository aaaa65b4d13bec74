/// A metadata value, one variant per GGUF value type.
///
/// Variants are declared in the order of their GGUF type ids (0 = `U8` ... 12 = `F64`). Arrays in a
/// file are homogeneous; nested arrays may differ from each other in element type and length.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

pub(crate) const TYPE_ARRAY: u32 = 9;

/// The fewest bytes a value of GGUF type `id` occupies; `None` for ids the format does not define.
///
/// Used to reject an array length before allocating for it.
pub(crate) fn min_encoded_len(id: u32) -> Option<usize> {
    Some(match id {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        TYPE_ARRAY => 12,
        _ => return None,
    })
}

impl MetaValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }

    pub(crate) fn type_id(&self) -> u32 {
        match self {
            MetaValue::U8(_) => 0,
            MetaValue::I8(_) => 1,
            MetaValue::U16(_) => 2,
            MetaValue::I16(_) => 3,
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::String(_) => 8,
            MetaValue::Array(_) => TYPE_ARRAY,
            MetaValue::U64(_) => 10,
            MetaValue::I64(_) => 11,
            MetaValue::F64(_) => 12,
        }
    }

    /// The type as an error message should show it: arrays with their element type.
    pub(crate) fn describe(&self) -> String {
        match self {
            MetaValue::Array(items) => match items.first() {
                Some(first) => format!("array of {}", first.type_name()),
                None => "empty array".into(),
            },
            v => v.type_name().into(),
        }
    }

    /// Any integer value that is non-negative: converters disagree on which integer type to store
    /// counts and ids in, so readers should not care.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            _ => self.as_i64().and_then(|v| u64::try_from(v).ok()),
        }
    }

    /// Any integer value that fits in an `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v.into()),
            MetaValue::I16(v) => Some(v.into()),
            MetaValue::I32(v) => Some(v.into()),
            MetaValue::I64(v) => Some(v),
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => i64::try_from(v).ok(),
            _ => None,
        }
    }

    /// Either float type; hyperparameters such as `rope.freq_base` are occasionally written as f64.
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            MetaValue::F32(v) => Some(v),
            MetaValue::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(items) => Some(items),
            _ => None,
        }
    }

    /// Appends the value's encoding, without its type id.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        match self {
            MetaValue::U8(v) => out.push(*v),
            MetaValue::I8(v) => out.extend(v.to_le_bytes()),
            MetaValue::U16(v) => out.extend(v.to_le_bytes()),
            MetaValue::I16(v) => out.extend(v.to_le_bytes()),
            MetaValue::U32(v) => out.extend(v.to_le_bytes()),
            MetaValue::I32(v) => out.extend(v.to_le_bytes()),
            MetaValue::F32(v) => out.extend(v.to_le_bytes()),
            MetaValue::Bool(v) => out.push(u8::from(*v)),
            MetaValue::String(s) => encode_str(s, out),
            MetaValue::Array(items) => {
                // An empty array's element type is irrelevant; u8 is what nothing can misread.
                let elem = items.first().map_or(0, MetaValue::type_id);
                out.extend(elem.to_le_bytes());
                out.extend((items.len() as u64).to_le_bytes());
                items.iter().for_each(|item| item.encode(out));
            }
            MetaValue::U64(v) => out.extend(v.to_le_bytes()),
            MetaValue::I64(v) => out.extend(v.to_le_bytes()),
            MetaValue::F64(v) => out.extend(v.to_le_bytes()),
        }
    }

    /// The first array (possibly nested) whose elements differ in type, which GGUF cannot encode.
    pub(crate) fn find_mixed_array(&self) -> Option<&[MetaValue]> {
        let items = self.as_array()?;
        let first = items.first()?.type_id();
        if items.iter().any(|item| item.type_id() != first) {
            return Some(items);
        }
        items.iter().find_map(MetaValue::find_mixed_array)
    }
}

pub(crate) fn encode_str(s: &str, out: &mut Vec<u8>) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

macro_rules! from_scalar {
    ($($t:ty => $variant:ident),*) => {
        $(impl From<$t> for MetaValue {
            fn from(v: $t) -> Self {
                MetaValue::$variant(v)
            }
        })*
    };
}

from_scalar!(
    u8 => U8, i8 => I8, u16 => U16, i16 => I16, u32 => U32, i32 => I32, f32 => F32,
    bool => Bool, String => String, u64 => U64, i64 => I64, f64 => F64
);

impl From<&str> for MetaValue {
    fn from(s: &str) -> Self {
        MetaValue::String(s.to_owned())
    }
}

impl<T: Into<MetaValue>> From<Vec<T>> for MetaValue {
    fn from(items: Vec<T>) -> Self {
        MetaValue::Array(items.into_iter().map(Into::into).collect())
    }
}
