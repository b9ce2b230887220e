//! [`from_slice`]: `serde_json::from_slice`, except that a struct is read only from a JSON object.
//!
//! serde's derived `Deserialize` of a struct also reads a JSON array of its fields in declaration
//! order (`[null, null]` is a `QueueBody` with no limits, `[5, 60000]` a `RateLimit`), a form no
//! client of the API means and that the OpenAPI document, which says `object`, does not allow.
//! [`from_slice`] reads through a deserializer that asks serde_json for a map wherever the type
//! asks for a struct (at the top and at every depth: a body, its nested structs, the elements of
//! its sequences, a struct variant of an enum), so such an array is refused as `invalid type:
//! sequence, expected struct ...`. A field whose type is a sequence (`Vec<T>`, a tuple) or a
//! `serde_json::Value` reads arrays as before.
//!
//! Not covered: a struct read through serde's buffered content (inside an untagged or internally
//! tagged enum, or a `#[serde(flatten)]` field), which serde deserializes from its own buffer.

use serde::de::{self, DeserializeSeed, Deserializer, EnumAccess, MapAccess, SeqAccess, VariantAccess, Visitor};

/// Deserialize `T` from JSON `bytes` as `serde_json::from_slice` does, with every struct read only
/// from a JSON object (see the module's documentation).
pub fn from_slice<'de, T: de::Deserialize<'de>>(bytes: &'de [u8]) -> serde_json::Result<T> {
    let mut deserializer = serde_json::Deserializer::from_slice(bytes);
    let value = T::deserialize(Objects(&mut deserializer))?;
    deserializer.end()?;
    Ok(value)
}

/// A deserializer that reads a struct only from a map, and wraps whatever it hands on.
struct Objects<D>(D);

/// A visitor whose nested deserializers, sequences, maps and enums are wrapped.
struct ObjectsVisitor<V>(V);

/// A seed that deserializes through [`Objects`].
struct ObjectsSeed<S>(S);

/// A sequence, map, enum or variant whose elements are deserialized through [`Objects`].
struct ObjectsAccess<A>(A);

/// A struct variant's fields, read as a map (through `newtype_variant_seed`).
struct StructVariant<V>(V);

macro_rules! forward {
    ($($method:ident),* $(,)?) => {
        $(
            fn $method<V: Visitor<'de>>(self, visitor: V) -> Result<V::Value, D::Error> {
                self.0.$method(ObjectsVisitor(visitor))
            }
        )*
    };
}

impl<'de, D: Deserializer<'de>> Deserializer<'de> for Objects<D> {
    type Error = D::Error;

    forward!(
        deserialize_any,
        deserialize_bool,
        deserialize_i8,
        deserialize_i16,
        deserialize_i32,
        deserialize_i64,
        deserialize_i128,
        deserialize_u8,
        deserialize_u16,
        deserialize_u32,
        deserialize_u64,
        deserialize_u128,
        deserialize_f32,
        deserialize_f64,
        deserialize_char,
        deserialize_str,
        deserialize_string,
        deserialize_bytes,
        deserialize_byte_buf,
        deserialize_option,
        deserialize_unit,
        deserialize_seq,
        deserialize_map,
        deserialize_identifier,
        deserialize_ignored_any,
    );

    fn deserialize_unit_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_unit_struct(name, ObjectsVisitor(visitor))
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, name: &'static str, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_newtype_struct(name, ObjectsVisitor(visitor))
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple(len, ObjectsVisitor(visitor))
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        name: &'static str,
        len: usize,
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_tuple_struct(name, len, ObjectsVisitor(visitor))
    }

    /// The point of the wrapper: a struct is read from a map, never from a sequence.
    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _name: &'static str,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_map(ObjectsVisitor(visitor))
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        name: &'static str,
        variants: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, D::Error> {
        self.0.deserialize_enum(name, variants, ObjectsVisitor(visitor))
    }

    fn is_human_readable(&self) -> bool {
        self.0.is_human_readable()
    }
}

macro_rules! visit {
    ($($method:ident($type:ty)),* $(,)?) => {
        $(
            fn $method<E: de::Error>(self, value: $type) -> Result<V::Value, E> {
                self.0.$method(value)
            }
        )*
    };
}

impl<'de, V: Visitor<'de>> Visitor<'de> for ObjectsVisitor<V> {
    type Value = V::Value;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        self.0.expecting(formatter)
    }

    visit!(
        visit_bool(bool),
        visit_i8(i8),
        visit_i16(i16),
        visit_i32(i32),
        visit_i64(i64),
        visit_i128(i128),
        visit_u8(u8),
        visit_u16(u16),
        visit_u32(u32),
        visit_u64(u64),
        visit_u128(u128),
        visit_f32(f32),
        visit_f64(f64),
        visit_char(char),
        visit_str(&str),
        visit_borrowed_str(&'de str),
        visit_string(String),
        visit_bytes(&[u8]),
        visit_borrowed_bytes(&'de [u8]),
        visit_byte_buf(Vec<u8>),
    );

    fn visit_none<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_none()
    }

    fn visit_unit<E: de::Error>(self) -> Result<V::Value, E> {
        self.0.visit_unit()
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.0.visit_some(Objects(deserializer))
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        self.0.visit_newtype_struct(Objects(deserializer))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, seq: A) -> Result<V::Value, A::Error> {
        self.0.visit_seq(ObjectsAccess(seq))
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<V::Value, A::Error> {
        self.0.visit_map(ObjectsAccess(map))
    }

    fn visit_enum<A: EnumAccess<'de>>(self, data: A) -> Result<V::Value, A::Error> {
        self.0.visit_enum(ObjectsAccess(data))
    }
}

impl<'de, S: DeserializeSeed<'de>> DeserializeSeed<'de> for ObjectsSeed<S> {
    type Value = S::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<S::Value, D::Error> {
        self.0.deserialize(Objects(deserializer))
    }
}

impl<'de, A: SeqAccess<'de>> SeqAccess<'de> for ObjectsAccess<A> {
    type Error = A::Error;

    fn next_element_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<Option<T::Value>, A::Error> {
        self.0.next_element_seed(ObjectsSeed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: MapAccess<'de>> MapAccess<'de> for ObjectsAccess<A> {
    type Error = A::Error;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, A::Error> {
        self.0.next_key_seed(ObjectsSeed(seed))
    }

    fn next_value_seed<T: DeserializeSeed<'de>>(&mut self, seed: T) -> Result<T::Value, A::Error> {
        self.0.next_value_seed(ObjectsSeed(seed))
    }

    fn size_hint(&self) -> Option<usize> {
        self.0.size_hint()
    }
}

impl<'de, A: EnumAccess<'de>> EnumAccess<'de> for ObjectsAccess<A> {
    type Error = A::Error;
    type Variant = ObjectsAccess<A::Variant>;

    fn variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<(T::Value, Self::Variant), A::Error> {
        let (value, variant) = self.0.variant_seed(ObjectsSeed(seed))?;
        Ok((value, ObjectsAccess(variant)))
    }
}

impl<'de, A: VariantAccess<'de>> VariantAccess<'de> for ObjectsAccess<A> {
    type Error = A::Error;

    fn unit_variant(self) -> Result<(), A::Error> {
        self.0.unit_variant()
    }

    fn newtype_variant_seed<T: DeserializeSeed<'de>>(self, seed: T) -> Result<T::Value, A::Error> {
        self.0.newtype_variant_seed(ObjectsSeed(seed))
    }

    fn tuple_variant<V: Visitor<'de>>(self, len: usize, visitor: V) -> Result<V::Value, A::Error> {
        self.0.tuple_variant(len, ObjectsVisitor(visitor))
    }

    /// A struct variant's content is read as a map, as a struct is.
    fn struct_variant<V: Visitor<'de>>(
        self,
        _fields: &'static [&'static str],
        visitor: V,
    ) -> Result<V::Value, A::Error> {
        self.0.newtype_variant_seed(StructVariant(visitor))
    }
}

impl<'de, V: Visitor<'de>> DeserializeSeed<'de> for StructVariant<V> {
    type Value = V::Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<V::Value, D::Error> {
        deserializer.deserialize_map(ObjectsVisitor(self.0))
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::{json, Value};

    use super::from_slice;

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Rate {
        limit: u32,
        period_ms: i64,
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(rename_all = "snake_case")]
    enum Shape {
        Unit,
        Newtype(Rate),
        Pair(u8, u8),
        Fields { rate: Rate },
    }

    #[derive(Debug, PartialEq, Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Body {
        name: Option<String>,
        rate: Option<Rate>,
        #[serde(default)]
        rates: Vec<Rate>,
        #[serde(default)]
        pair: Option<(u8, u8)>,
        #[serde(default)]
        shape: Option<Shape>,
        #[serde(default)]
        any: Value,
    }

    fn read(text: &str) -> Result<Body, String> {
        from_slice::<Body>(text.as_bytes()).map_err(|e| e.to_string())
    }

    /// The bug schemathesis found: `PUT /v1/queues/{name}` took the body `[null, null]`.
    #[test]
    fn a_struct_is_not_read_from_an_array() {
        for text in [
            "[null, null]",
            "[]",
            r#"{"rate": [5, 60000]}"#,
            r#"{"rates": [[5, 60000]]}"#,
            r#"{"shape": {"newtype": [5, 60000]}}"#,
            r#"{"shape": {"fields": [[5, 60000]]}}"#,
            r#"{"shape": {"fields": {"rate": [5, 60000]}}}"#,
        ] {
            let error = read(text).expect_err(text);
            assert!(error.contains("invalid type: sequence, expected struct"), "{text}: {error}");
        }
        // serde_json alone reads them all.
        assert!(serde_json::from_str::<Body>("[null, null]").is_ok());
        assert!(serde_json::from_str::<Body>(r#"{"rate": [5, 60000]}"#).is_ok());
    }

    #[test]
    fn objects_sequences_and_values_read_as_with_serde_json() {
        for text in [
            "{}",
            r#"{"name": "q", "rate": {"limit": 5, "period_ms": 60000}}"#,
            r#"{"rates": [{"limit": 1, "period_ms": 2}], "pair": [1, 2]}"#,
            r#"{"shape": "unit"}"#,
            r#"{"shape": {"newtype": {"limit": 1, "period_ms": 2}}}"#,
            r#"{"shape": {"pair": [1, 2]}}"#,
            r#"{"shape": {"fields": {"rate": {"limit": 1, "period_ms": 2}}}}"#,
            r#"{"any": [1, [2, {"a": [3]}], null, "x", 1.5]}"#,
            r#"{"name": null, "rate": null}"#,
        ] {
            let ours = read(text).unwrap_or_else(|e| panic!("{text}: {e}"));
            let theirs: Body = serde_json::from_str(text).unwrap();
            assert_eq!(ours, theirs, "{text}");
        }
        assert_eq!(from_slice::<Vec<Value>>(b"[1, {}]").unwrap(), vec![json!(1), json!({})]);
        assert_eq!(from_slice::<Value>(b"[null]").unwrap(), json!([null]));
    }

    #[test]
    fn errors_are_serde_json_errors() {
        for (text, expected) in [
            (r#"{"rate": {"limit": 1}}"#, "missing field `period_ms`"),
            (r#"{"other": 1}"#, "unknown field `other`"),
            (r#"{"rate": {"limit": -1, "period_ms": 2}}"#, "invalid value: integer `-1`"),
            ("{} {}", "trailing characters"),
            ("{", "EOF while parsing"),
            ("null", "invalid type: null, expected struct Body"),
        ] {
            let error = read(text).expect_err(text);
            assert!(error.contains(expected), "{text}: {error}");
        }
    }
}
