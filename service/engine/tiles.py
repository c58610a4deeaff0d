"""How quantized weights lie in memory: the tiles kernels/csrc/kernels.h reads, which quantized.py's
converters fill. A matrix is stored in tiles of 16 rows (the last padded), each tile's blocks of 32
inputs in order, each block laid out so that one 64-byte load holds 4 inputs of each of the 16 rows,
the operands of one vpdpbusd; the float16 scales (and int4m's minimums) lie [tiles, blocks, 16 rows].
"""

import torch

# The layout the kernels read (kernels.h: kBlock, kTileOutputs, kGroupInputs), which the converter
# writes: quantized.check_layout holds them to the loaded kernels' own, and the converted file's name
# and metadata carry them (LAYOUT_TOKEN), so a file of another layout is never read.
GROUP = 32
TILE_OUTPUTS = 16
GROUP_INPUTS = 4
LAYOUT_TOKEN = f"t{TILE_OUTPUTS}k{GROUP_INPUTS}g{GROUP}"


def padded_rows(outputs: int) -> int:
    """Return the rows stored for a matrix: a multiple of TILE_OUTPUTS."""
    return -(-outputs // TILE_OUTPUTS) * TILE_OUTPUTS


def pad_rows(matrix: torch.Tensor, fill: int = 0) -> torch.Tensor:
    """Return a matrix with rows of `fill` added to a multiple of TILE_OUTPUTS."""
    padded = torch.full((padded_rows(matrix.shape[0]), *matrix.shape[1:]), fill, dtype=matrix.dtype)
    padded[: matrix.shape[0]] = matrix
    return padded


def tile_int8(stored: torch.Tensor) -> torch.Tensor:
    """Lay out offset int8 weights [padded rows, inputs] as kernels.h reads them: per tile, per block,
    per group of 4 inputs, the 16 rows' 4 bytes side by side."""
    rows, inputs = stored.shape
    tiles = stored.reshape(rows // TILE_OUTPUTS, TILE_OUTPUTS, inputs // GROUP, GROUP // GROUP_INPUTS, GROUP_INPUTS)
    return tiles.permute(0, 2, 3, 1, 4).reshape(rows, inputs).contiguous()


def untile_int8(tiled: torch.Tensor) -> torch.Tensor:
    """Undo tile_int8."""
    rows, inputs = tiled.shape
    tiles = tiled.reshape(rows // TILE_OUTPUTS, inputs // GROUP, GROUP // GROUP_INPUTS, TILE_OUTPUTS, GROUP_INPUTS)
    return tiles.permute(0, 3, 1, 2, 4).reshape(rows, inputs)


def tile_scales(scales: torch.Tensor) -> torch.Tensor:
    """Lay out float16 scales [outputs, blocks] as kernels.h reads them: padded, [tiles, blocks, 16 rows]
    (returned as [padded rows, blocks])."""
    padded = pad_rows(scales)
    rows, blocks = padded.shape
    return padded.reshape(rows // TILE_OUTPUTS, TILE_OUTPUTS, blocks).transpose(1, 2).contiguous().reshape(rows, blocks)


def tile_scales_and_minimums(scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
    """Lay out float16 scales and minimums [outputs, blocks] as kernels.h reads int4m's: padded, [tiles,
    blocks, 2, 16 rows], a block's 16 scales and then its 16 minimums (returned as [padded rows, 2 * blocks])."""
    tiled = [tile_scales(part) for part in (scales, minimums)]
    rows, blocks = tiled[0].shape
    parts = [part.reshape(rows // TILE_OUTPUTS, blocks, TILE_OUTPUTS) for part in tiled]
    return torch.stack(parts, dim=2).reshape(rows, 2 * blocks)


def untile_scales(tiled: torch.Tensor) -> torch.Tensor:
    """Undo tile_scales (the padded rows kept), as float32."""
    rows, blocks = tiled.shape
    return tiled.reshape(rows // TILE_OUTPUTS, blocks, TILE_OUTPUTS).transpose(1, 2).reshape(rows, blocks).float()


def pack_nibbles(nibbles: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit values [padded rows, inputs] as the kernel reads them: each block of a tile holds its 16
    rows' groups of 4 inputs side by side, group p's in the low nibbles and group p + 4's in the high ones."""
    rows, inputs = nibbles.shape
    # [tiles, 16 rows, blocks, 2 halves, 4 groups, 4 inputs] -> [tiles, blocks, 4 groups, 16 rows, 4 inputs]
    parts = nibbles.reshape(rows // TILE_OUTPUTS, TILE_OUTPUTS, inputs // GROUP, 2, 4, GROUP_INPUTS)
    parts = parts.permute(0, 2, 3, 4, 1, 5)
    packed = parts[:, :, 0] | (parts[:, :, 1] << 4)
    return packed.reshape(rows, inputs // 2).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """Undo pack_nibbles, as float32 values 0..15."""
    rows, inputs = packed.shape[0], packed.shape[1] * 2
    packed = packed.reshape(rows // TILE_OUTPUTS, inputs // GROUP, 4, TILE_OUTPUTS, GROUP_INPUTS)
    halves = torch.stack([packed & 0x0F, packed >> 4], dim=2)  # [tiles, blocks, 2, 4, 16, 4]
    return halves.permute(0, 4, 1, 2, 3, 5).reshape(rows, inputs).float()


def pack_int6(stored: torch.Tensor) -> torch.Tensor:
    """Lay out offset 6-bit values [padded rows, inputs] (0..63) as the kernel reads them: per tile's
    block, the low 4 bits as pack_nibbles lays them out (256 bytes), then the top 2 bits (128 bytes):
    byte 64 * q + 4 * row + k holds those of nibble load 2q's low and high nibbles (bits 0-1, 2-3)
    and of load 2q + 1's (bits 4-5, 6-7)."""
    rows, inputs = stored.shape
    tiles, blocks = rows // TILE_OUTPUTS, inputs // GROUP
    nibbles = pack_nibbles(stored & 0x0F).reshape(tiles, blocks, TILE_OUTPUTS * GROUP // 2)
    # [tiles, 16 rows, blocks, 8 groups of 4 inputs, 4] -> [tiles, blocks, 8 groups, 16 rows x 4 inputs]
    top = (stored >> 4).reshape(tiles, TILE_OUTPUTS, blocks, GROUP // GROUP_INPUTS, GROUP_INPUTS)
    top = top.permute(0, 2, 3, 1, 4).reshape(tiles, blocks, GROUP // GROUP_INPUTS, TILE_OUTPUTS * GROUP_INPUTS)
    loads = [top[:, :, 2 * q] | (top[:, :, 2 * q + 4] << 2) | (top[:, :, 2 * q + 1] << 4) | (top[:, :, 2 * q + 5] << 6)
             for q in (0, 1)]
    return torch.cat([nibbles, *loads], dim=2).reshape(rows, inputs * 3 // 4).contiguous()


def unpack_int6(packed: torch.Tensor) -> torch.Tensor:
    """Undo pack_int6, as float32 values 0..63."""
    rows, inputs = packed.shape[0], packed.shape[1] * 4 // 3
    tiles, blocks = rows // TILE_OUTPUTS, inputs // GROUP
    parts = packed.reshape(tiles, blocks, -1)
    nibble_bytes = TILE_OUTPUTS * GROUP // 2
    low = unpack_nibbles(parts[:, :, :nibble_bytes].reshape(rows, inputs // 2))
    loads = parts[:, :, nibble_bytes:].reshape(tiles, blocks, 2, TILE_OUTPUTS * GROUP_INPUTS)
    top = torch.empty(tiles, blocks, GROUP // GROUP_INPUTS, TILE_OUTPUTS * GROUP_INPUTS, dtype=torch.uint8)
    for q in (0, 1):
        for shift, group in ((0, 2 * q), (2, 2 * q + 4), (4, 2 * q + 1), (6, 2 * q + 5)):
            top[:, :, group] = (loads[:, :, q] >> shift) & 0x3
    top = top.reshape(tiles, blocks, GROUP // GROUP_INPUTS, TILE_OUTPUTS, GROUP_INPUTS).permute(0, 3, 1, 2, 4)
    return low + 16 * top.reshape(rows, inputs).float()
