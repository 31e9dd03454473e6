//! Tensors and items in slots: typed, aligned, read in place.

mod common;

use std::io::Write;

use common::{child_result, pattern, scribble, spawn_child, Name, Rng};
use pinshm::testing as layout;
use pinshm::{
    codec::{DType, Item, ItemLayout, TensorRef},
    store::{ObjectHandle, ObjectKind, StoreHandle},
    Error, ObjectStore, StoreConfig, StoreReader,
};

const MIB: usize = 1 << 20;

fn store(name: &Name, capacity: usize, max: usize) -> ObjectStore {
    ObjectStore::create(StoreConfig::new(capacity, max, 1).name(&**name)).unwrap()
}

#[test]
fn every_dtype_round_trips_in_place_and_aligned() {
    let name = Name::new("dtypes");
    let mut w = store(&name, 4 * MIB, MIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    for (i, dtype) in DType::ALL.into_iter().enumerate() {
        let shape = [3u64, 5, 7];
        let mut bytes = pattern(i as u64, 105 * dtype.size());
        if dtype == DType::Bool {
            bytes.iter_mut().for_each(|b| *b &= 1);
        }
        let t = TensorRef::new(dtype, &shape[..], &bytes).unwrap();
        let h = w.put_tensor(&format!("t{i}"), &t).unwrap();
        let v = r.get_tensor(h).unwrap();
        assert_eq!(v.dtype(), dtype);
        assert_eq!(v.shape(), &shape);
        assert_eq!(v.numel(), 105);
        assert_eq!(v.bytes(), &bytes[..]);
        assert_eq!(
            v.bytes().as_ptr() as usize % 64,
            0,
            "{dtype:?} payload aligned"
        );
    }
}

#[test]
fn typed_views_check_dtype_and_never_panic() {
    let name = Name::new("typed");
    let mut w = store(&name, 4 * MIB, MIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let xs: Vec<f32> = (0..12).map(|i| i as f32 * 0.5).collect();
    let h = w
        .put_tensor("f", &TensorRef::from_slice(&xs, vec![3, 4]).unwrap())
        .unwrap();
    let v = r.get_tensor(h).unwrap();
    assert_eq!(v.as_slice::<f32>().unwrap(), &xs[..]);
    assert!(matches!(
        v.as_slice::<i32>(),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        v.as_slice::<f64>(),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(v.as_bools().is_err());
    drop(v);
    let hs: Vec<half::bf16> = (0..4).map(|i| half::bf16::from_f32(i as f32)).collect();
    let h = w
        .put_tensor("bf", &TensorRef::from_slice(&hs, vec![4]).unwrap())
        .unwrap();
    assert_eq!(
        r.get_tensor(h).unwrap().as_slice::<half::bf16>().unwrap(),
        &hs[..]
    );
    let bools = [1u8, 0, 1];
    let h = w
        .put_tensor("b", &TensorRef::new(DType::Bool, vec![3], &bools).unwrap())
        .unwrap();
    assert_eq!(
        r.get_tensor(h).unwrap().as_bools().unwrap(),
        &[true, false, true]
    );
    // A raw object is not a tensor, and a tensor is not an item.
    let raw = w.put("raw", b"bytes").unwrap();
    assert!(matches!(
        r.get_tensor(raw),
        Err(Error::WrongKind {
            expected: ObjectKind::Tensor,
            found: ObjectKind::Raw
        })
    ));
    assert!(matches!(
        r.get_item(h),
        Err(Error::WrongKind {
            expected: ObjectKind::Item,
            found: ObjectKind::Tensor
        })
    ));
}

#[test]
fn zero_d_empty_and_bad_shapes() {
    let name = Name::new("shapes");
    let mut w = store(&name, 4 * MIB, MIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w
        .put_tensor("scalar", &TensorRef::from_slice(&[42i64], vec![]).unwrap())
        .unwrap();
    let v = r.get_tensor(h).unwrap();
    assert_eq!(v.shape(), &[] as &[u64]);
    assert_eq!(v.as_slice::<i64>().unwrap(), &[42]);
    drop(v);
    let h = w
        .put_tensor(
            "empty",
            &TensorRef::new(DType::F32, vec![0, 7], &[]).unwrap(),
        )
        .unwrap();
    let v = r.get_tensor(h).unwrap();
    assert_eq!((v.shape(), v.numel()), (&[0u64, 7][..], 0));
    assert_eq!(v.as_slice::<f32>().unwrap(), &[] as &[f32]);
    assert!(TensorRef::new(DType::F32, vec![2], &[0u8; 7]).is_err());
    assert!(
        TensorRef::new(DType::F32, vec![1; 9], &[0u8; 4]).is_err(),
        "more than 8 dims"
    );
    assert!(
        TensorRef::new(DType::F64, vec![u64::MAX, 2], &[]).is_err(),
        "overflow"
    );
    assert!(matches!(
        w.put_tensor_with("big", DType::U8, &[2 * MIB as u64], |_| {}),
        Err(Error::TooLarge { .. })
    ));
}

#[test]
fn a_64_mib_tensor_round_trips_without_copy() {
    let name = Name::new("bigtensor");
    let len = 64 * MIB;
    let mut w = store(&name, len + MIB, len + 4096);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let h = w
        .put_tensor_with("big", DType::F32, &[16, 1024, 1024], |p| {
            for (i, c) in p.chunks_exact_mut(4).enumerate() {
                c.copy_from_slice(&(i as f32).to_le_bytes());
            }
        })
        .unwrap();
    let v = r.get_tensor(h).unwrap();
    let xs = v.as_slice::<f32>().unwrap();
    assert_eq!(xs.len(), len / 4);
    assert!(xs
        .iter()
        .enumerate()
        .step_by(4099)
        .all(|(i, &x)| x == i as f32));
    assert_eq!(xs[xs.len() - 1], (xs.len() - 1) as f32);
}

fn mm_item(pixels: &[f32]) -> Item<'_> {
    Item::new()
        .meta("modality", "image")
        .meta("hash", "9f2c0d")
        .field(
            "pixel_values",
            TensorRef::from_slice(pixels, vec![3, 32, 32]).unwrap(),
        )
        .field(
            "image_grid_thw",
            TensorRef::from_slice(&[1i64, 16, 16][..], vec![1, 3]).unwrap(),
        )
        .field(
            "patch_mask",
            TensorRef::new(DType::Bool, vec![5], &[1, 1, 0, 1, 0][..]).unwrap(),
        )
        .field(
            "embeds",
            TensorRef::from_slice(&[0.25f64; 10][..], vec![2, 5]).unwrap(),
        )
        .field(
            "empty",
            TensorRef::new(DType::I32, vec![0], &[][..]).unwrap(),
        )
}

fn check_mm_item(r: &StoreReader, h: ObjectHandle) {
    let pixels: Vec<f32> = (0..3 * 32 * 32).map(|i| i as f32).collect();
    let v = r.get_item(h).unwrap();
    assert_eq!(v.meta("modality"), Some("image"));
    assert_eq!(v.meta("hash"), Some("9f2c0d"));
    assert_eq!(
        v.names().collect::<Vec<_>>(),
        [
            "pixel_values",
            "image_grid_thw",
            "patch_mask",
            "embeds",
            "empty"
        ]
    );
    let p = v.field("pixel_values").unwrap();
    assert_eq!(p.shape(), &[3, 32, 32]);
    assert_eq!(p.as_slice::<f32>().unwrap(), &pixels[..]);
    assert_eq!(
        v.field("image_grid_thw")
            .unwrap()
            .as_slice::<i64>()
            .unwrap(),
        &[1, 16, 16]
    );
    assert_eq!(
        v.field("patch_mask").unwrap().as_bools().unwrap(),
        &[true, true, false, true, false]
    );
    assert_eq!(
        v.field("embeds").unwrap().as_slice::<f64>().unwrap(),
        &[0.25; 10]
    );
    assert_eq!(v.field("empty").unwrap().numel(), 0);
    for n in v.names() {
        assert_eq!(
            v.field(n).unwrap().bytes().as_ptr() as usize % 64,
            0,
            "{n} aligned"
        );
    }
    assert!(matches!(v.field("nope"), Err(Error::NoSuchField { .. })));
}

#[test]
#[ignore = "child process entry point: its parent test runs it with --ignored"]
fn child_item_reader() {
    let Ok(_) = std::env::var("PINSHM_CHILD") else {
        return;
    };
    let sh: StoreHandle = serde_json::from_str(&std::env::var("PINSHM_HANDLE").unwrap()).unwrap();
    let r = StoreReader::attach(&sh).unwrap();
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    let h: ObjectHandle = serde_json::from_str(&line).unwrap();
    check_mm_item(&r, h);
    println!("RESULT item ok");
}

#[test]
fn an_item_of_five_fields_is_read_in_place_by_another_process() {
    let name = Name::new("item");
    let mut w = store(&name, 4 * MIB, MIB);
    let pixels: Vec<f32> = (0..3 * 32 * 32).map(|i| i as f32).collect();
    let h = w.put_item("img0", &mm_item(&pixels)).unwrap();
    let mut child = spawn_child(
        "child_item_reader",
        "item",
        &[("PINSHM_HANDLE", serde_json::to_string(&w.handle()).unwrap())],
    );
    writeln!(
        child.stdin.take().unwrap(),
        "{}",
        serde_json::to_string(&h).unwrap()
    )
    .unwrap();
    assert_eq!(child_result(child), "item ok");
    // And in this process, through the in-place writer.
    let layout = ItemLayout::new()
        .meta("modality", "image")
        .meta("hash", "9f2c0d")
        .field("pixel_values", DType::F32, vec![3, 32, 32])
        .field("image_grid_thw", DType::I64, vec![1, 3])
        .field("patch_mask", DType::Bool, vec![5])
        .field("embeds", DType::F64, vec![2, 5])
        .field("empty", DType::I32, vec![0])
        .finish()
        .unwrap();
    let h2 = w
        .put_item_with("img1", &layout, |s| {
            let mut f = s.all_mut();
            f[0].copy_from_slice(bytemuck::cast_slice(&pixels));
            f[1].copy_from_slice(bytemuck::cast_slice(&[1i64, 16, 16]));
            f[2].copy_from_slice(&[1, 1, 0, 1, 0]);
            f[3].copy_from_slice(bytemuck::cast_slice(&[0.25f64; 10]));
        })
        .unwrap();
    let r = StoreReader::attach(&w.handle()).unwrap();
    check_mm_item(&r, h2);
}

#[test]
fn corrupted_tensor_and_item_headers_give_errors() {
    let name = Name::new("codeccorrupt");
    let mut w = store(&name, 4 * MIB, MIB);
    let r = StoreReader::attach(&w.handle()).unwrap();
    let pixels = vec![1.0f32; 3 * 32 * 32];
    let header_len = layout::header_len(1) as u64;
    let prefix = layout::slot_prefix_len(1) as u64;
    let mut rng = Rng(77);
    let mut errors = 0;
    for round in 0..300u64 {
        let h = if round % 2 == 0 {
            w.put_tensor(
                &format!("t{round}"),
                &TensorRef::from_slice(&pixels[..64], vec![8, 8]).unwrap(),
            )
            .unwrap()
        } else {
            w.put_item(&format!("i{round}"), &mm_item(&pixels)).unwrap()
        };
        // Random bytes over the object's own header (first 128 / 256 bytes).
        let obj = header_len + h.address + prefix;
        for _ in 0..1 + rng.below(4) {
            let at = obj + rng.below(if round % 2 == 0 { 128 } else { 256 });
            scribble(&name, at, &[rng.next() as u8]);
        }
        let res = if round % 2 == 0 {
            r.get_tensor(h).map(|v| {
                let _ = v.as_slice::<f32>();
                v.bytes().len()
            })
        } else {
            r.get_item(h).map(|v| {
                let names: Vec<String> = v.names().map(str::to_owned).collect();
                names
                    .iter()
                    .map(|n| v.field(n).map(|f| f.bytes().len()).unwrap_or(0))
                    .sum()
            })
        };
        if let Err(e) = res {
            assert!(matches!(e, Error::CorruptObject(_)), "{e}");
            errors += 1;
        }
        r.acknowledge(h).ok();
        w.free_unused();
    }
    assert!(errors > 100, "most scribbles are caught ({errors})");
}
