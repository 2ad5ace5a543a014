"""Machine failures in masktrl/io.py's words: a full disk whatever the file's size (safetensors and
torch.save report it in their own words), the kernel's own file systems, running out of memory."""

import errno
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from masktrl.io import atomic_dir, disk_errors, disk_problem, file_system_type, memory_error_line, writer_os_error


@pytest.fixture
def one_mib_disk(tmp_path):
    """A 1 MiB file system (a tmpfs: needs root, else the test is skipped)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize("floats", [300_000, 3_000_000])  # 1.2 MB and 12 MB: more than the free space by far
def test_safetensors_on_a_full_disk_is_enospc_for_any_size(one_mib_disk, floats):
    dest = one_mib_disk / "ckpt"
    with pytest.raises(OSError) as e:
        with atomic_dir(dest) as tmp:
            save_file({"w": torch.zeros(floats)}, str(tmp / "model.safetensors"))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(dest.with_name("ckpt.tmp"))
    assert isinstance(e.value.__context__, SafetensorError)  # the writer's own words stay attached
    assert not dest.exists() and not dest.with_name("ckpt.tmp").exists()  # the space is given back


def test_torch_save_on_a_full_disk_is_enospc(one_mib_disk):
    dest = one_mib_disk / "state"
    with pytest.raises(OSError) as e:
        with atomic_dir(dest) as tmp:
            torch.save({"w": torch.zeros(3_000_000)}, tmp / "trainer_state.pt")
    assert e.value.errno == errno.ENOSPC


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES])
def test_safetensors_os_error_number_is_read_from_its_message(tmp_path, number):
    exc = SafetensorError(
        f"Error while serializing: I/O error: {__import__('os').strerror(number)} (os error {number})"
    )
    problem = writer_os_error(exc, tmp_path / "x")
    assert (problem.errno, problem.filename) == (number, str(tmp_path / "x"))


def test_torch_writer_failure_on_a_disk_with_room_is_still_one_os_error(tmp_path):
    with pytest.raises(OSError) as e:
        with disk_errors(tmp_path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert e.value.errno == errno.EIO and "unexpected pos 576 vs 534" in e.value.strerror


def test_other_exceptions_on_a_disk_with_room_stay_what_they_are(tmp_path):
    with pytest.raises(ValueError, match="a bug"):
        with disk_errors(tmp_path):
            raise ValueError("a bug")
    assert writer_os_error(SafetensorError("header too large"), tmp_path) is None


def test_proc_is_not_a_writable_folder_not_a_full_disk():
    assert file_system_type(Path("/proc/self")) == "proc"
    problem = disk_problem(Path("/proc/masktrl-out/run"))
    assert problem is not None and problem.strerror == "not a writable folder (a proc file system, the kernel's own)"
    assert disk_problem(Path("/tmp")) is None


def test_memory_errors_are_one_line():
    try:
        torch.empty(2**50, dtype=torch.uint8)  # a petabyte: the CPU allocator refuses at once
    except RuntimeError as exc:
        line = memory_error_line(exc)
    assert line.startswith("out of memory (DefaultCPUAllocator: can't allocate memory: you tried to allocate")
    assert "\n" not in line and "enforce fail" not in line and "rollout.batch_size" in line
    cuda = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.06 GiB is free. Including non-PyTorch memory, this "
        "process has 78.1 GiB in use."
    )
    assert memory_error_line(cuda).startswith(
        "out of memory (CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total "
        "capacity of 79.19 GiB of which 1.06 GiB is free): "
    )
    assert memory_error_line(MemoryError()).startswith("out of memory (MemoryError): ")
    assert memory_error_line(RuntimeError("shape mismatch")) is None
