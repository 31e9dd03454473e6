"""pinshm's exceptions form one tree: `except pinshm.PinshmError` catches
every error pinshm raises, and `except ValueError` (MemoryError,
TimeoutError, KeyError, TypeError) still catches those it caught before."""

import pickle

import numpy as np
import pytest

import pinshm

KIB = 1 << 10

#: Each class, and the builtin it is too (None: a PinshmError only).
TREE = {
    "StaleError": ValueError,
    "FullError": MemoryError,
    "NoSpaceError": MemoryError,
    "WaitTimeoutError": TimeoutError,
    "KeyNotFoundError": KeyError,
    "NotFoundError": FileNotFoundError,
    "WrongKindError": TypeError,
    "InvalidArgumentError": ValueError,
    "InUseError": FileExistsError,
    "UntrustedError": None,
    "WriterGoneError": None,
    "CancelledError": None,
}


@pytest.mark.parametrize("name", sorted(TREE))
def test_every_error_class_is_a_pinshm_error_and_its_builtin(name):
    cls = getattr(pinshm, name)
    assert name in pinshm.__all__
    assert cls.__module__ == "pinshm" and cls.__name__ == name
    assert issubclass(cls, pinshm.PinshmError)
    if TREE[name] is not None:
        assert issubclass(cls, TREE[name])
    # Picklable by name (an error sent from a worker process).
    err = pickle.loads(pickle.dumps(cls("why")))
    assert type(err) is cls and "why" in str(err)


def test_pinshm_error_is_an_exception_and_nothing_narrower():
    assert pinshm.PinshmError.__bases__ == (Exception,)


def test_a_missing_segment_is_a_not_found_error_by_every_name_a_caller_tries(unique_name):
    name = unique_name()
    for call in (
        lambda: pinshm.StoreReader.attach_by_name(name),
        lambda: pinshm.StoreHandle.of(name),
    ):
        e = _raised(call)
        assert type(e) is pinshm.NotFoundError, repr(e)
        assert isinstance(e, FileNotFoundError) and isinstance(e, OSError) and isinstance(e, pinshm.PinshmError)
        assert name in str(e)


def _raised(call):
    """The exception `call()` raises (it must raise one)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 - returned for the caller's checks
        return e
    raise AssertionError("expected an exception")


def test_the_errors_the_store_raises_are_caught_by_both_names(store, reader, unique_name, closing):
    h = store.put("k", b"v")
    store.clear_hard()
    stale = _raised(lambda: reader.get(h))
    h = store.put("k", b"v")
    duplicate = _raised(lambda: store.put("k", b"again"))
    too_large = _raised(lambda: store.put("big", bytes(2 << 20)))
    missing = _raised(lambda: store.add_reference("absent"))
    wrong_kind = _raised(lambda: reader.get_item(h))
    small = closing(pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=unique_name()))

    def fill():
        for i in range(10):
            small.put(f"k{i}", bytes(16 * KIB))

    full = _raised(fill)
    bad_config = _raised(lambda: pinshm.ObjectStore(64 * KIB, 16 * KIB, 0, name=unique_name()))
    for e, cls, builtin in [
        (stale, pinshm.StaleError, ValueError),
        (duplicate, pinshm.InvalidArgumentError, ValueError),
        (too_large, pinshm.InvalidArgumentError, ValueError),
        (missing, pinshm.KeyNotFoundError, KeyError),
        (wrong_kind, pinshm.WrongKindError, TypeError),
        (full, pinshm.FullError, MemoryError),
        (bad_config, pinshm.InvalidArgumentError, ValueError),
    ]:
        assert type(e) is cls, repr(e)
        assert isinstance(e, pinshm.PinshmError) and isinstance(e, builtin), repr(e)


def test_the_errors_the_channel_raises_are_caught_by_both_names(channel):
    tx, rx = channel
    timeout = _raised(lambda: rx.recv(timeout=0))
    assert type(timeout) is pinshm.WaitTimeoutError
    assert isinstance(timeout, pinshm.PinshmError) and isinstance(timeout, TimeoutError)
    rx.cancel()
    cancelled = _raised(lambda: rx.recv(timeout=1))
    assert type(cancelled) is pinshm.CancelledError and isinstance(cancelled, pinshm.PinshmError)


def test_a_tensor_of_another_dtype_is_a_wrong_kind_error(store, reader):
    h = store.put("raw", b"not a tensor")
    with pytest.raises(pinshm.PinshmError) as e:
        reader.get_tensor(h)
    assert isinstance(e.value, TypeError)
    ht = store.put_tensor("t", np.ones(3, np.float32))
    reader.get_tensor(ht)


def test_a_taken_name_is_an_in_use_error_also_a_file_exists_error(unique_name, closing):
    # What the reaper tells a live writer by, instead of the message's text.
    name = unique_name()
    closing(pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=name))
    with pytest.raises(pinshm.InUseError) as e:
        pinshm.ObjectStore(64 * KIB, 16 * KIB, 1, name=name)
    assert isinstance(e.value, FileExistsError) and name in str(e.value)


@pytest.mark.parametrize(
    "make, argument",
    [
        (lambda: pinshm.ObjectStore(1 << 50, 1 << 20, 1, reserve=False), "capacity"),
        (lambda: pinshm.Broadcast(1, 1 << 40, 1 << 30), "slots"),
        (lambda: pinshm.Broadcast(1 << 40, 4, 64), "n_readers"),
        # 64 TiB of channel, sparse: more than any machine here backs.
        (lambda: pinshm.Broadcast(1, 1 << 16, 1 << 30), "slot_size"),
    ],
    ids=["store-1PiB", "slots-2^40", "readers-2^40", "channel-64TiB"],
)
def test_absurd_sizes_are_refused_up_front_naming_the_argument(make, argument):
    with pytest.raises(pinshm.InvalidArgumentError, match=argument) as e:
        make()
    assert "OverflowError" not in repr(e.value)
