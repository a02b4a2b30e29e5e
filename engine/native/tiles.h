/* Where a tile's bytes are in the weights' layout (layout.py `pack`, encode.c `wq_encode`).

A weight is tiles of 16 outputs, each a block per group of G inputs: `body` bytes of codes
in 64-byte vectors, then the tile's 16 fp16 scales and 16 fp16 offsets (64 bytes). int8 and
2-bit weights store each tile's blocks in turn. int4 weights store tiles by pairs (2t, 2t+1;
a last odd tile alone), a group at a time, and within a group the two tiles' vectors by turns
(tile 2t's vector j, then tile 2t+1's), then tile 2t's scales and tile 2t+1's: so a pair of
tiles, which a decode step's products multiply together (wq.c `pair_rows`), is one stream of
bytes in the order it is read, which the hardware prefetchers follow. Two streams a tile
apart read at 23 GB/s on the 2-core EPYC Zen 4 where one stream read at 29. */
#ifndef AHEAD_TILES_H
#define AHEAD_TILES_H

#include <stdint.h>

#define TILE 16

/* Tile t's first vector of its first group; the strides between its vectors and between its
   groups; the offset from a group's first vector to its scales. */
typedef struct {
    const uint8_t *p;
    int64_t vs, gs, so;
} Tile;

/* Tile t of a weight of `tiles` tiles, `groups` groups of G inputs, `bits` a code. */
static inline Tile tile_at(const uint8_t *w, int bits, int64_t tiles, int64_t groups,
                           int64_t G, int64_t t) {
    const int64_t body = G * TILE * bits / 8, block = body + 4 * TILE;
    const int64_t u = bits == 4 ? t & 1 : 0, width = bits == 4 && (t | 1) < tiles ? 2 : 1;
    return (Tile){w + (t - u) * groups * block + 64 * u, 64 * width, block * width,
                  body * width};
}

#endif
