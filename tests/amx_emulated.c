/* wq.c with its AMX instructions carried out in C, one tile register file a thread: so that
on a CPU without AMX the tests run wq.c's AMX kernels (`amx_chain`, `amx_tiles`: where they
read the weights' layout, which tiles and rows they multiply, how they fold) and compare their
bits with the VNNI kernels', as an AMX CPU would run them. Built by tests/test_native.py. */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include "../engine/native/vecmath.h"

#ifndef AMX_INTRINSICS
#error "this compiler lacks the AMX intrinsics, so wq.c has no AMX kernels to emulate"
#endif

static __thread uint8_t emu_tile[8][16][64];
static __thread TileConfig emu_cfg;

static void emu_loadconfig(const void *cfg) { memcpy(&emu_cfg, cfg, sizeof emu_cfg); }

static void emu_loadd(int t, const void *base, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy(emu_tile[t][r], (const uint8_t *)base + r * stride, emu_cfg.colsb[t]);
}

static void emu_stored(int t, void *base, int64_t stride) {
    for (int r = 0; r < emu_cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, emu_tile[t][r], emu_cfg.colsb[t]);
}

/* TDPBSUD: C[m][n] += sum over k, i of A's signed byte [m][4k + i] times B's unsigned byte
   [k][4n + i], in int32 */
static void emu_dpbsud(int c, int a, int b) {
    for (int m = 0; m < emu_cfg.rows[a]; m++)
        for (int n = 0; n < emu_cfg.colsb[c] / 4; n++) {
            int32_t sum;
            memcpy(&sum, &emu_tile[c][m][4 * n], 4);
            for (int k = 0; k < emu_cfg.colsb[a] / 4; k++)
                for (int i = 0; i < 4; i++)
                    sum += (int8_t)emu_tile[a][m][4 * k + i] *
                           (int32_t)emu_tile[b][k][4 * n + i];
            memcpy(&emu_tile[c][m][4 * n], &sum, 4);
        }
}

#undef _tile_loadd
#undef _tile_stored
#undef _tile_zero
#undef _tile_dpbsud
#undef _tile_release
#define _tile_loadconfig(cfg) emu_loadconfig(cfg)
#define _tile_loadd(t, base, stride) emu_loadd(t, base, stride)
#define _tile_stored(t, base, stride) emu_stored(t, base, stride)
#define _tile_zero(t) memset(emu_tile[t], 0, sizeof emu_tile[t])
#define _tile_dpbsud(c, a, b) emu_dpbsud(c, a, b)
#define _tile_release() ((void)0)

#include "../engine/native/wq.c"

/* Calls of enough rows run the AMX kernels from now on, as `wq_amx_enable` turns them on. */
void wq_emulate_amx(void) { amx_on = 1; }
