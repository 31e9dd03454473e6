"""GPU kit: host registration in several chunks (run by run.sh). With
PINSHM_PIN_CHUNK_MIB=64, a reserved 256 MiB store is registered in calls of
at most 64 MiB, in the writer and in a reader (pin="require"); objects of
40 MiB are stored so that some cross a chunk boundary, and each is copied
host to device from its slot and device to host into a new slot, every byte
checked. Prints its figures and ends with PASS or FAIL."""

import os
import sys
import time

os.environ["PINSHM_PIN_CHUNK_MIB"] = "64"  # read at each registration

import numpy as np  # noqa: E402
import torch  # noqa: E402

import pinshm  # noqa: E402
import pinshm.device  # noqa: E402

MIB = 1 << 20
OBJ = 40 * MIB


def main():
    failures = []
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    store = pinshm.ObjectStore(256 * MIB, OBJ + MIB, 1, reserve=True, pin="require", cache=True)
    reader = pinshm.StoreReader.attach(store.handle(), 0, pin="require")
    p = reader.pinning
    print(f"store and reader pinned in {time.perf_counter() - t0:.2f} s; reader: {p}")
    expect_chunks = -(-p["bytes"] // (64 * MIB)) if p else None
    if not p or p["chunks"] != expect_chunks or p["chunks"] < 4:
        failures.append(f"the reader's registration took {p and p['chunks']} calls, expected {expect_chunks} (>= 4)")
    base, _ = reader.data_region()
    crossed = 0
    for i in range(5):
        x = np.random.default_rng(i).integers(0, 256, OBJ, dtype=np.uint8)
        h = store.put_tensor(f"x{i}", x)
        view = reader.get_tensor(h)
        addr = view.__array_interface__["data"][0]
        # Chunks start at the mapping's start, a header before the data
        # region: counted from the data region, this is off by at most one.
        if (addr - base) // (64 * MIB) != (addr - base + OBJ - 1) // (64 * MIB):
            crossed += 1
        on_dev = torch.from_dlpack(view).to(dev, non_blocking=True)
        torch.cuda.synchronize()
        if not torch.equal(on_dev.cpu(), torch.from_numpy(x)):
            failures.append(f"object {i}: bytes on the device differ (host to device)")
        back = pinshm.device.put_tensor(store, f"y{i}", on_dev)
        if not np.array_equal(np.asarray(reader.get_tensor(back)), x):
            failures.append(f"object {i}: bytes in the slot differ (device to host)")
        del view
    print(f"objects of 40 MiB across a 64 MiB chunk boundary (roughly): {crossed}")
    reader.close()
    store.close()
    if failures:
        print("py_chunked_pin: FAIL: " + "; ".join(failures))
        return 1
    print("py_chunked_pin: PASS")
    return 0


if __name__ == "__main__":
    sys.exit(main())
