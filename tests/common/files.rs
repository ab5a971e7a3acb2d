//! Valid files in the formats the program reads, written here: the seeds of the fuzz targets
//! and the inputs of the readers' tests.

use std::path::Path;
use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::SerializedFileWriter;
use parquet::schema::parser::parse_message_type;

/// A PNG of `side` × `side` pixels.
pub fn png(pixels: &[u8], side: u32, colour: png::ColorType) -> Vec<u8> {
    let mut out = vec![];
    let mut enc = png::Encoder::new(&mut out, side, side);
    enc.set_color(colour);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()
        .unwrap()
        .write_image_data(pixels)
        .unwrap();
    out
}

/// A Parquet file as the Hub's conversion has it: a struct column `image_col` of (bytes,
/// path) and an int64 `label`, Snappy-compressed. `pngs[i]` is row i's image bytes.
pub fn write_parquet(path: &Path, image_col: &str, pngs: &[Vec<u8>], labels: &[i64]) {
    let schema = format!(
        "message schema {{ optional group {image_col} {{ optional binary bytes; \
         optional binary path (UTF8); }} optional int64 label; }}"
    );
    let props = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .build();
    let file = std::fs::File::create(path).unwrap();
    let mut w = SerializedFileWriter::new(
        file,
        Arc::new(parse_message_type(&schema).unwrap()),
        Arc::new(props),
    )
    .unwrap();
    let n = labels.len();
    let mut rg = w.next_row_group().unwrap();
    let bytes: Vec<ByteArray> = pngs.iter().map(|b| ByteArray::from(b.clone())).collect();
    let mut col = rg.next_column().unwrap().unwrap();
    col.typed::<ByteArrayType>()
        .write_batch(&bytes, Some(&vec![2; n]), None)
        .unwrap();
    col.close().unwrap();
    // path: null in every row (the struct is present, its field is not)
    let mut col = rg.next_column().unwrap().unwrap();
    col.typed::<ByteArrayType>()
        .write_batch(&[], Some(&vec![1; n]), None)
        .unwrap();
    col.close().unwrap();
    let mut col = rg.next_column().unwrap().unwrap();
    col.typed::<Int64Type>()
        .write_batch(labels, Some(&vec![1; n]), None)
        .unwrap();
    col.close().unwrap();
    rg.close().unwrap();
    w.close().unwrap();
}
