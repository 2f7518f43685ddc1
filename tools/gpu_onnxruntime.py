"""Packs onnxruntime-gpu for the lent GPU machine, whose own onnxruntime is a CPU build and which
takes at most 64 MiB per call.

The wheel is 255 MB, 218 MB of it CUDA kernels for six GPU generations in the CUDA provider's
``.nv_fatbin`` section. The machine's GPU is a Hopper (sm_90), so the kernels of the other
generations are overwritten with zeros where they lie: every offset stays as it was, the sm_90
kernels stay byte for byte, and the zeros compress to nothing. The package (no wheel: the result is
unpacked on the machine) goes into an xz tarball split in two parts, each carried by its own call:

    python -m shmserve.tools.gpu_onnxruntime          # -> .ort/part1, .ort/part2 (~50 + ~18 MB)

``tools/gpu_run.sh`` joins the parts (the first stashed in /tmp/ort-parts by an earlier call on the
same warm machine) and unpacks them in place of the machine's onnxruntime, beside the NVIDIA pip
packages of its torch: onnxruntime-gpu 1.31 is built for CUDA 13, which that torch brings
(``nvidia/cu13/lib``, cuDNN 9), and the backend loads those libraries from there.
"""
from __future__ import annotations

import argparse
import io
import shutil
import struct
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

VERSION = "1.31.1"
PROVIDER = "onnxruntime/capi/libonnxruntime_providers_cuda.so"
FATBIN_MAGIC = 0xBA55ED50
PART_BYTES = 50 * 1024 * 1024


def section(elf: bytes | bytearray, wanted: str) -> tuple[int, int]:
    """(file offset, size) of an ELF64 section, read from the section header table."""
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    names_off, = struct.unpack_from("<Q", elf, shoff + shstrndx * shentsize + 0x18)
    for i in range(shnum):
        header = shoff + i * shentsize
        name_at, = struct.unpack_from("<I", elf, header)
        name = elf[names_off + name_at:elf.index(b"\0", names_off + name_at)].decode()
        if name == wanted:
            offset, size = struct.unpack_from("<QQ", elf, header + 0x18)
            return offset, size
    raise ValueError(f"no {wanted} section")


def keep_only_arch(elf: bytearray, arch: int) -> dict[int, int]:
    """Zero the payload of every fatbin entry built for another GPU architecture; bytes kept per arch."""
    offset, size = section(elf, ".nv_fatbin")
    kept: dict[int, int] = {}
    pos, end = offset, offset + size
    while pos + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", elf, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned, with padding between them
            pos += 8
            continue
        entry, body_end = pos + header_size, pos + header_size + body_size
        while entry < body_end:
            _kind, _v, entry_header, payload = struct.unpack_from("<HHIQ", elf, entry)
            entry_arch, = struct.unpack_from("<I", elf, entry + 28)
            if entry_arch == arch:
                kept[arch] = kept.get(arch, 0) + payload
            else:
                elf[entry + entry_header:entry + entry_header + payload] = bytes(payload)
            entry += entry_header + payload
        pos = body_end
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(".ort"))
    parser.add_argument("--arch", type=int, default=90, help="the GPU architecture kept (sm_90: H100, H200)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "-d", tmp, f"onnxruntime-gpu=={VERSION}"], check=True)
        wheel = next(Path(tmp).glob("onnxruntime_gpu-*.whl"))
        buffer = io.BytesIO()
        with zipfile.ZipFile(wheel) as z, tarfile.open(fileobj=buffer, mode="w:xz", preset=9) as tar:
            for info in z.infolist():
                if info.is_dir():  # folders come with the files in them
                    continue
                data = z.read(info)
                if info.filename == PROVIDER:
                    elf = bytearray(data)
                    kept = keep_only_arch(elf, args.arch)
                    print(f"{PROVIDER}: kept {kept.get(args.arch, 0) >> 20} MiB of sm_{args.arch} kernels, "
                          f"zeroed the other architectures'", flush=True)
                    data = bytes(elf)
                member = tarfile.TarInfo(info.filename)
                member.size, member.mode = len(data), 0o755 if ".so" in info.filename else 0o644
                tar.addfile(member, io.BytesIO(data))
    packed = buffer.getvalue()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    for i in range(0, len(packed), PART_BYTES):
        (args.out / f"part{i // PART_BYTES + 1}").write_bytes(packed[i:i + PART_BYTES])
    print(f"onnxruntime-gpu {VERSION}: {len(packed) / 2**20:.1f} MiB in "
          f"{', '.join(f'{p} ({p.stat().st_size / 2**20:.1f} MiB)' for p in sorted(args.out.iterdir()))}")


if __name__ == "__main__":
    main()
