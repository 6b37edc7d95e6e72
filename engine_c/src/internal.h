/*
 * internal.h - structures and interfaces shared by the engine's source files.
 * Not installed; the public API is include/echospec_engine.h.
 *
 * Files and their owners of concern:
 *   gguf.c        GGUF v2/v3 reader over mmap, with every field checked
 *   model.c       es_model: hyperparameters and per-layer tensor binding
 *   quant.c       block layouts, the kernels' determinism contract, scalar
 *                 reference kernels, row dequantizers, activation
 *                 quantization, weight packing (quant.h)
 *   matmul.c      the es_matmul driver: chunks over the pool, activation
 *                 quantization per call, kernel choice, scratch sizing
 *   quant_avx512.c  AVX-512 (VNNI) kernels, same signatures as scalar
 *   quant_avx2.c  AVX2 kernels, same signatures as scalar (and the es_x86_*
 *                 getters of a build without AVX-512)
 *   quant_neon.c  NEON (dotprod) kernels, same signatures as scalar
 *   threadpool.c  persistent pool: spin while a forward runs, sleep between
 *   kv_cache.c    the KV cache: layout (F16, blocks of positions), append,
 *                 rollback, block loads for the attention
 *   session.c     sessions: creation, scratch, rollback
 *   attention.c   the attention: online softmax over KV blocks, its work
 *                 units (attention.h)
 *   sparse.c      block-sparse attention: per-block key bounds, the choice
 *                 of the blocks a decode step attends
 *   forward.c     the forward pass (its stage map at the top) and the
 *                 es_forward / es_decode calls
 *   tree.c        token-tree verification: es_forward_tree's checks and
 *                 attention, es_session_keep_path
 *   rowops.h      small row kernels shared by forward.c and attention.c
 *                 (exp, RMSNorm, SwiGLU, max / argmax, the lane types)
 *   sampler.c     es_sample
 *
 * Determinism contract (what makes speculation on vs off byte-identical):
 * every output element of every kernel is computed by a sequence of
 * floating-point operations that depends only on the element's own inputs,
 * never on N (tokens in the call), on the thread split, or on the SIMD path.
 * All files are compiled with -ffp-contract=off.
 */
#ifndef ES_INTERNAL_H
#define ES_INTERNAL_H

#include <stddef.h>
#include <stdint.h>

#include "../include/echospec_engine.h"

/* ggml tensor type ids, as stored in GGUF tensor infos. */
enum {
    ES_TYPE_F32 = 0,
    ES_TYPE_F16 = 1,
    ES_TYPE_Q4_0 = 2,
    ES_TYPE_Q4_1 = 3,
    ES_TYPE_Q5_0 = 6,
    ES_TYPE_Q5_1 = 7,
    ES_TYPE_Q8_0 = 8,
    ES_TYPE_Q8_1 = 9,
    ES_TYPE_Q2_K = 10,
    ES_TYPE_Q3_K = 11,
    ES_TYPE_Q4_K = 12,
    ES_TYPE_Q5_K = 13,
    ES_TYPE_Q6_K = 14,
    ES_TYPE_Q8_K = 15,
    ES_TYPE_BF16 = 30
};

/* ---- gguf.c ------------------------------------------------------------ */

/* GGUF metadata value types (GGUF spec). */
enum {
    GGUF_T_UINT8 = 0, GGUF_T_INT8 = 1, GGUF_T_UINT16 = 2, GGUF_T_INT16 = 3,
    GGUF_T_UINT32 = 4, GGUF_T_INT32 = 5, GGUF_T_FLOAT32 = 6, GGUF_T_BOOL = 7,
    GGUF_T_STRING = 8, GGUF_T_ARRAY = 9, GGUF_T_UINT64 = 10, GGUF_T_INT64 = 11,
    GGUF_T_FLOAT64 = 12
};

/* One tensor as described by the file; data points into the mapping. */
typedef struct {
    char *name;                 /* NUL-terminated copy (owned by es_gguf) */
    uint32_t type;              /* ES_TYPE_* (validated: known and supported block size) */
    int32_t n_dims;             /* 1..4 */
    int64_t ne[4];              /* ne[0] = innermost (row length in elements); unused dims = 1 */
    int64_t n_elements;         /* product of ne, checked for overflow */
    size_t nbytes;              /* bytes of data (checked inside the file) */
    size_t row_bytes;           /* bytes of one row of ne[0] elements */
    const void *data;           /* inside the mmap, aligned as the file says */
    void *packed;               /* NULL, or the rows repacked for the SIMD kernels
                                   (quant.h: es_tensor_pack, es_tensor_pack_into) */
    size_t packed_bytes;
    int packed_owned;           /* 1: packed was malloc'd for this tensor (freed with it);
                                   0: it lies in the model's weight arena */
} es_tensor;

/* One metadata key/value. Scalars are decoded; strings and arrays point into the map. */
typedef struct {
    char *key;                  /* NUL-terminated copy */
    uint32_t type;              /* GGUF_T_* */
    union {
        uint64_t u64;           /* every unsigned integer type and bool */
        int64_t i64;            /* every signed integer type */
        double f64;             /* float32 and float64 */
    } v;
    const char *str;            /* GGUF_T_STRING: bytes (not NUL-terminated) */
    uint64_t str_len;
    uint32_t arr_type;          /* GGUF_T_ARRAY: element type */
    uint64_t arr_len;           /* GGUF_T_ARRAY: element count */
    const void *arr_data;       /* GGUF_T_ARRAY: first element in the map */
} es_gguf_kv;

typedef struct {
    void *map;                  /* whole file, PROT_READ */
    size_t size;                /* bytes */
    uint32_t version;           /* 2 or 3 */
    uint64_t alignment;         /* general.alignment or 32 */
    int64_t n_kv;
    es_gguf_kv *kv;
    int64_t n_tensors;
    es_tensor *tensors;
} es_gguf;

/* Open and validate a GGUF file. On failure returns a status and writes a
 * message naming the field to err; *out is NULL and nothing leaks. */
es_status es_gguf_open(const char *path, es_gguf **out, char *err, size_t err_len);
void es_gguf_close(es_gguf *g);
const es_gguf_kv *es_gguf_find_kv(const es_gguf *g, const char *key);
const es_tensor *es_gguf_find_tensor(const es_gguf *g, const char *name);

/* Bytes per block and elements per block of a tensor type; 0 when unsupported. */
size_t es_type_block_bytes(uint32_t type);
int64_t es_type_block_elems(uint32_t type);
const char *es_type_name(uint32_t type);

/* The weights check of es_model_load (check.c): ES_ERR_BAD_WEIGHTS with a message naming
 * the tensor and block when a scale or a float value of a tensor of g is NaN or infinite;
 * full (ES_MODEL_CHECK_WEIGHTS) also decodes every quantized value. */
es_status es_check_weights(const es_gguf *g, int full, char *err, size_t err_len);

/* ---- model.c ----------------------------------------------------------- */

typedef struct {
    const es_tensor *attn_norm;     /* [n_embd] */
    const es_tensor *wq;            /* [n_head * head_dim rows][n_embd] */
    const es_tensor *wk;            /* [n_head_kv * head_dim][n_embd] */
    const es_tensor *wv;            /* [n_head_kv * head_dim][n_embd] */
    const es_tensor *bq, *bk, *bv;  /* qwen2 biases or NULL */
    const es_tensor *q_norm;        /* qwen3 [head_dim] or NULL */
    const es_tensor *k_norm;        /* qwen3 [head_dim] or NULL */
    const es_tensor *wo;            /* [n_embd][n_head * head_dim] */
    const es_tensor *attn_post_norm; /* gemma3 [n_embd]: RMSNorm of the attention output, or NULL */
    const es_tensor *ffn_norm;      /* [n_embd] */
    const es_tensor *ffn_post_norm; /* gemma3 [n_embd]: RMSNorm of the FFN output, or NULL */
    const es_tensor *w_gate;        /* [n_ff][n_embd] */
    const es_tensor *w_up;          /* [n_ff][n_embd] */
    const es_tensor *w_down;        /* [n_embd][n_ff] */
    int swa;                        /* 1: sliding-window attention (info.n_swa), local RoPE base */
    /* mixture of experts (qwen3moe, qwen3vlmoe; NULL otherwise, and w_gate/w_up/w_down are NULL) */
    const es_tensor *gate_inp;      /* router [n_expert][n_embd] */
    es_tensor *exp_gate;            /* [n_expert] views of ffn_gate_exps: each [n_ff_exp][n_embd] */
    es_tensor *exp_up;              /* [n_expert] views of ffn_up_exps:   each [n_ff_exp][n_embd] */
    es_tensor *exp_down;            /* [n_expert] views of ffn_down_exps: each [n_embd][n_ff_exp] */
} es_layer;

struct es_model {
    es_gguf *gguf;
    es_model_info info;
    const es_tensor *tok_embd;      /* [n_vocab][n_embd] */
    const es_tensor *output_norm;   /* [n_embd] */
    const es_tensor *output;        /* [n_vocab][n_embd]; == tok_embd when tied */
    es_layer *layers;               /* [n_layer] */
    float emb_scale;                /* gemma3: embeddings times sqrtf(n_embd); 0: none */
    float attn_scale;               /* scores = q . k * attn_scale (1 / sqrt(head_dim), gemma3 27B: see model.c) */
    int gelu;                       /* 1: gelu(gate) * up (tanh form); 0: SwiGLU */
    es_tensor *expert_views;        /* owned: [n_layer][3][n_expert] 2-D views of the 3-D expert
                                       tensors (each expert a matrix of its own), NULL when dense */
    /* float copies of small vectors (norms, biases), converted at load time */
    float *f32_pool;                /* owned */
};

/* Float view of a 1-D tensor converted at load (norm weights, biases). */
const float *es_model_vec(const es_model *m, const es_tensor *t);

/* ---- threadpool.c ------------------------------------------------------ */

typedef struct es_pool es_pool;
typedef void (*es_task_fn)(void *ctx, int ith, int nth);

/* A pool of n_threads - 1 workers plus the calling thread. NULL on failure. */
es_pool *es_pool_new(int n_threads);
void es_pool_free(es_pool *pool);
/* Threads a run uses (the active ones; the pool's size unless set lower). */
int es_pool_size(const es_pool *pool);
/* Threads of the pool (fixed at es_pool_new). */
int es_pool_capacity(const es_pool *pool);
/* Let the next runs use the first n threads, n in [1, capacity] (-1 otherwise,
 * nothing changes); the other workers sleep. Call between runs, outside
 * es_pool_begin/end, from the thread that runs the pool. */
int es_pool_set_active(es_pool *pool, int n);
/* 1 when worker ith (1 <= ith < capacity) sleeps on its condition variable
 * at this moment, else 0 (for tests). */
int es_pool_asleep(const es_pool *pool, int ith);
/* Run fn(ctx, ith, nth) for ith in [0, nth), nth = es_pool_size (the caller
 * runs ith = 0), and return when all are done. The workers of the run spin
 * between es_pool_begin and es_pool_end (one forward call) and sleep
 * otherwise. */
void es_pool_run(es_pool *pool, es_task_fn fn, void *ctx);
void es_pool_begin(es_pool *pool);
void es_pool_end(es_pool *pool);

/* ---- quant.c / matmul.c / quant_avx512.c / quant_avx2.c / quant_neon.c -- */

/* Dequantize n elements (a multiple of the block size) of a row to float. */
void es_dequantize_row(uint32_t type, const void *src, float *dst, int64_t n);

/* Scratch bytes es_matmul needs for N activation rows of n_in elements. */
size_t es_matmul_scratch_bytes(uint32_t type, int64_t n_in, int N);

/*
 * Y[N][n_out] = X[N][n_in] . W^T  where W is a 2-D tensor with ne[0] = n_in
 * and ne[1] = n_out (so row r of W is output r).
 *   X, Y   float32, row-major, Y rows are ldy floats apart (ldy >= n_out)
 *   scratch  es_matmul_scratch_bytes(W->type, n_in, N) bytes, 64-byte aligned
 * Activations are quantized once per call when the weight type is quantized;
 * each weight block is unpacked once and multiplied into all N rows. Output
 * rows are split across the pool's threads. Bitwise independent of N, the
 * thread count and the SIMD path (see the contract at the top).
 */
void es_matmul(es_pool *pool, const es_tensor *W, const float *X, int N,
               float *Y, int64_t ldy, void *scratch);

/* SIMD path name compiled in (es_simd_name returns it). */
const char *es_quant_simd_name(void);

/* ---- vision.c ----------------------------------------------------------- */

/* es_vision_encode (which calls it with reference 0); reference != 0 runs the plain scalar twins
 * of the matrix and attention kernels (one fmaf chain per element, no lanes), which give the
 * same bits: the C tests compare the two. */
es_status es_vision_encode_path(es_vision *v, const float *pixels, int32_t height, int32_t width,
                                int32_t n_threads, float *embd_out, float *deepstack_out, int reference);

/* ---- kv_cache.c --------------------------------------------------------- */

/* Positions per KV block. The attention's online softmax works a block at a
 * time, and the blocks are fixed by absolute position ([b * ES_KV_BLOCK,
 * (b + 1) * ES_KV_BLOCK)), so a query's arithmetic is the same whatever the
 * call, batch or thread split (attention.c). A multiple of 32 (two 16-lane vectors). */
#define ES_KV_BLOCK 64
#define ES_MAX_HEAD_DIM 512 /* the largest head_dim a model may declare (attention.key_length) */

/*
 * One KV sequence, IEEE binary16 (F16; float32 rounded to nearest even, so a
 * value above 65504 in magnitude becomes infinity), or Q8_0 (type; the block
 * layout above es_kv_block_off). Per layer l, in blocks (F16 shown):
 *   k  [n_head_kv][nb][head_dim][ES_KV_BLOCK]   a block's keys transposed: one
 *        key dimension of its positions is contiguous, so the scores of 8 or
 *        16 positions are one vector operation per dimension
 *   v  [n_head_kv][nb][ES_KV_BLOCK][head_dim]
 * A global layer has nb = n_blk blocks (position p in block p / ES_KV_BLOCK).
 * A sliding-window layer (gemma3's local layers) has a ring of nb = ring /
 * ES_KV_BLOCK blocks: position p at slot p % ring, so absolute block b is
 * ring block b % nb; ring is a multiple of ES_KV_BLOCK, so a block of
 * positions is a block of slots and the attention's blocks, fixed by
 * absolute position, are unchanged. Each (layer, KV head) is one contiguous
 * run of blocks in k and in v, so an attention over it reads two sequential
 * streams. Positions [0, n_past) are valid in the global layers, [ring_lo,
 * n_past) in the rings (ring_lo: the oldest position no later one has
 * overwritten). A forward writes [n_past, n_past + N) and then advances
 * n_past; rollback only moves n_past back: a later forward overwrites the
 * removed positions, and nothing of them reaches a result (attention reads
 * positions <= its own). A ring stays exact while every forward writes at
 * most `piece` tokens and starts where the window of its first token,
 * [n_past - n_swa + 1, n_past), is still held: es_kv_rollback refuses the
 * n_past for which it is not (es_kv_min_past).
 * KV eviction (evict): every layer has sink_blk blocks that hold positions
 * [0, sink_blk * ES_KV_BLOCK) for good, then a ring of ring positions for
 * the later ones: absolute block b >= sink_blk at block sink_blk + (b -
 * sink_blk) % (nb - sink_blk). n_blk is then those nb blocks plus one (what
 * the attention's per-block scratch needs: a call's blocks, es_attn_blocks),
 * and n_ctx bounds nothing.
 */
typedef struct {
    uint8_t *k, *v;             /* this layer's blocks in the cache's mappings (blk_bytes each) */
    int32_t nb;                 /* blocks: n_blk, or ring / ES_KV_BLOCK on a sliding-window layer */
} es_kv_layer;

typedef struct {
    es_kv_layer *layer;         /* owned: [n_layer] */
    void *map[4];               /* owned anonymous mappings, zeroed at allocation: k and v of the
                                   global layers, k and v of the rings (NULL when none) */
    size_t map_bytes[4];
    int32_t n_ctx;              /* capacity (tokens) */
    int32_t n_past;             /* valid positions */
    int32_t n_blk;              /* ceil(n_ctx / ES_KV_BLOCK) */
    int32_t ring;               /* positions of a sliding-window layer's ring; n_blk * ES_KV_BLOCK
                                   when they keep every position (no window, swa_full, short n_ctx) */
    int32_t piece;              /* most tokens one forward may write (the slack); 0: no limit */
    int32_t ring_lo;            /* the rings hold positions [ring_lo, n_past) */
    int32_t n_swa;              /* the rings' window: es_model_info.n_swa, or kv_window (eviction) */
    int32_t evict;              /* 1: KV eviction (every layer: sinks, then a ring; n_ctx bounds nothing) */
    int32_t sinks;              /* eviction: positions [0, sinks) every query attends */
    int32_t sink_blk;           /* eviction: ceil(sinks / ES_KV_BLOCK) blocks kept for good before the ring */
    int32_t n_layer, n_head_kv, head_dim;
    int32_t type;               /* es_kv_type: ES_KV_F16 or ES_KV_Q8_0 */
    size_t blk_bytes;           /* bytes of one block of K (or of V) of one KV head (below) */
} es_kv;

/* Allocate an empty cache of n_ctx positions for the model's shapes, its
 * sliding-window layers (m->layers[l].swa) in rings of n_swa + slack
 * positions rounded up to ES_KV_BLOCK (slack >= 1), or of every position when
 * full is 1 or that is no smaller. On failure returns ES_ERR_NOMEM (or
 * ES_ERR_INVALID_ARG for a malformed ECHOSPEC_MEM_AVAILABLE) with a message
 * and leaves *kv empty. */
es_status es_kv_init(es_kv *kv, const es_model *m, int32_t n_ctx, int32_t slack, int full, int32_t sinks,
                     int32_t window, int32_t type, char *err, size_t err_len);
void es_kv_free(es_kv *kv);
/* The positions a forward may write up to: n_ctx, or with eviction ES_EVICT_MAX_POS. */
static inline int32_t es_kv_capacity(const es_kv *kv) { return kv->evict ? ES_EVICT_MAX_POS : kv->n_ctx; }
/* Bytes of k and v together, every layer. */
size_t es_kv_bytes(const es_kv *kv);
/* The smallest n_past > 0 a rollback can reach, 0 when any is (the rings
 * hold the window of position n_past for every n_past >= it). */
int32_t es_kv_min_past(const es_kv *kv);
/* Keep positions [0, n_past); ES_ERR_INVALID_ARG (cache unchanged) unless
 * 0 <= n_past <= kv->n_past and n_past is 0 or >= es_kv_min_past. */
es_status es_kv_rollback(es_kv *kv, int32_t n_past, char *err, size_t err_len);
/* After a forward wrote positions [n_past, n_past + n): advance n_past and ring_lo. */
void es_kv_advance(es_kv *kv, int32_t n);
/* Elements [r0, r1) of the key (or value) row x ([n_head_kv * head_dim]) of
 * position pos in layer l, rounded to F16 (or quantized to Q8_0), into the cache. */
void es_kv_put_k(es_kv *kv, int l, int32_t pos, int64_t r0, int64_t r1, const float *x);
void es_kv_put_v(es_kv *kv, int l, int32_t pos, int64_t r0, int64_t r1, const float *x);
/* Block b (absolute: positions [b * ES_KV_BLOCK, (b + 1) * ES_KV_BLOCK)) of
 * KV head g of layer l, where the layer keeps it (a ring: block b % nb), as
 * a byte offset. A block is blk_bytes long:
 *   F16   K: [head_dim][B] halves; V: [B][head_dim] halves (hd * B * 2 bytes)
 *   Q8_0  K: int8 q [head_dim][B], then F16 scales [head_dim / 32][B];
 *         V: int8 q [B][head_dim], then F16 scales [B][head_dim / 32]
 *         (hd * B + hd / 32 * B * 2 bytes): the scale of dimension d of
 *         position t is the scale of d's run of 32 (es_kv_type), kept
 *         beside the int8s in the orientation the attention reads. */
static inline size_t es_kv_block_off(const es_kv *kv, int l, int g, int32_t b) {
    int32_t nb = kv->layer[l].nb, sb = kv->sink_blk;
    int32_t slot = b < nb ? b : sb + (b - sb) % (nb - sb);
    return ((size_t)g * (size_t)nb + (size_t)slot) * kv->blk_bytes;
}
static inline const uint8_t *es_kv_k_block(const es_kv *kv, int l, int g, int32_t b) {
    return kv->layer[l].k + es_kv_block_off(kv, l, g, b);
}
static inline const uint8_t *es_kv_v_block(const es_kv *kv, int l, int g, int32_t b) {
    return kv->layer[l].v + es_kv_block_off(kv, l, g, b);
}
/* Bytes of one block of K (or V) of a KV head of head_dim dimensions. */
static inline size_t es_kv_blk_bytes(int32_t type, int hd) {
    size_t n = (size_t)hd * ES_KV_BLOCK;
    return type == ES_KV_Q8_0 ? n + n / 32 * sizeof(uint16_t) : n * sizeof(uint16_t);
}
/* The Q8_0 block (es_kv_type) of the 32 floats x: *d its F16 scale, q its
 * int8 values (ggml's quantize_row_q8_0_ref; a NaN quantizes to 0). */
void es_kv_quantize_q8_0(const float *x, uint16_t *d, int8_t *q);
/* dst[i] = es_fp32_to_fp16(src[i]) for i in [0, n), with the SIMD path's
 * conversion where there is one (bitwise the scalar function's result). */
void es_fp32_to_fp16_row(uint16_t *dst, const float *src, int n);
/* Ask the hardware for blocks [0, n_blk_used) of layer l's K and V (of a
 * ring, at most its nb). */
void es_kv_prefetch(const es_kv *kv, int l, int32_t n_blk_used);
/* Ask for (absolute) block b of KV head g of layer l (K and V), into L2. */
void es_kv_prefetch_block(const es_kv *kv, int l, int g, int32_t b);

/* ---- session.c / forward.c ---------------------------------------------- */

#define ES_MAX_CTX (1 << 20)
#define ES_MAX_THREADS 256
/* Bytes of a thread's output-matmul chunk when only the argmax is wanted: the
 * chunk's logits of every head row stay in that thread's L1 / L2 between the
 * kernel that writes them and the epilogue that reduces them. */
#define ES_HEAD_TMP_BYTES (16 * 1024)
#define ES_MAX_EXPERT 512   /* experts per layer a model may declare (expert_count) */
#define ES_MAX_EXPERT_USED 16   /* experts per token (expert_used_count) */
#define ES_MAX_GROUP 32     /* query heads attended together per work unit */
#define KS_MAX_TOKENS 8     /* attention: calls of up to this many tokens split each head group's blocks
                               across threads (key split, attention.c) */
#define ATT_Q_TARGET 12     /* queries (tokens x heads of one KV head) a query-split attention unit aims at */
#define ES_MAX_UNIT_Q (KS_MAX_TOKENS * ES_MAX_GROUP)   /* queries of one attention unit, at most */

/* One KV sequence, its thread pool and the scratch of a call (an opaque
 * handle outside the library; created and sized in session.c, used by the
 * forward pass in forward.c and attention.c). */
struct es_session {
    const es_model *model;
    es_kv kv;               /* the KV cache: capacity kv.n_ctx, valid positions [0, kv.n_past) */
    int32_t n_threads;      /* threads of the pool (es_session_set_threads: how many a call uses) */
    es_pool *pool;
    /* scratch, sized for cap tokens per call (es_forward_batch: the tokens of every session of
       the batch, on the scratch of the session that runs it) */
    int32_t cap;
    float *x;               /* [cap][n_embd] residual stream */
    float *xb;              /* [cap][n_embd] normed input of a sublayer */
    float *q;               /* [cap][q_dim] */
    float *k;               /* [cap][kv_dim] */
    float *v;               /* [cap][kv_dim] */
    float *att;             /* [cap][q_dim] attention output */
    float *gate;            /* [cap][n_ff] */
    float *up;              /* [cap][n_ff] */
    float *out;             /* [cap][n_embd] sublayer output */
    float *logits;          /* [cap][n_vocab] */
    float *rope;            /* [cap][2][rope_dim] cos, sin interleaved per pair: the global layers'
                               table, then the sliding-window layers' (models with local layers) */
    int32_t group_cap;      /* min(n_head / n_head_kv, ES_MAX_GROUP) */
    int32_t q_cap;          /* queries of an attention unit, at most */
    float *att_ws;          /* [n_threads][ws_floats] attention scratch (es_attn_ws_floats), 64-byte aligned */
    size_t ws_floats;
    float *parts;           /* [KS_MAX_TOKENS][n_head][kv.n_blk][es_attn_part_floats] blocks' results (key split) */
    _Atomic int *grp_done;  /* [n_head] chunks done per head group (key split) */
    /* sparse attention (sparse.c; NULL and 0 when sparse_topk is 0) */
    int32_t sparse_topk;    /* blocks chosen by the bound beside the sink and recent ones */
    uint16_t *kv_bound;     /* [n_layer][n_head_kv][kv.n_blk][2][head_dim] F16: the element-wise min,
                               then max, of the keys of each block's valid positions (global layers) */
    int32_t *sparse_sel;    /* [n_layer][n_head_kv][kv.n_blk] the blocks of the layer's last
                               sparse call, ascending */
    int32_t *sparse_nsel;   /* [n_layer] their count per KV head; 0: the last call was dense */
    void *sparse_rank;      /* [kv.n_blk] scratch of the selection */
    void *mm_scratch;       /* es_matmul scratch, 64-byte aligned */
    float *am_val;          /* [cap][am_slots] argmax of each output-matmul chunk (am_epi): value, */
    int32_t *am_idx;        /* and index in the row (-1: only NaNs, or in slot 0: the first logit is
                               NaN; < -1: no chunk starts there) */
    int32_t am_slots;       /* ceil(n_vocab / ES_EPI_ROWS) */
    float *head_tmp;        /* [n_threads][head_tmp_floats] an output-matmul chunk per thread when only
                               the argmax is wanted (am_local), 64-byte aligned */
    size_t head_tmp_floats; /* max(ES_HEAD_TMP_BYTES / 4, cap * ES_EPI_ROWS), a multiple of 16 */
    _Atomic int *att_done;  /* [cap] attention units (query split) or head groups (key split) done
                               per token slice */
    void *glu_q8;           /* [cap] SwiGLU output rows quantized for W_down (glu_epi), 64-byte
                               aligned, zeroed at allocation (the padding of a row's last group) */
    size_t mm_bytes;
    /* mixture of experts (moe.c): the scratch of one chunk of moe_cap rows (NULL when dense) */
    int32_t moe_cap;        /* rows of a chunk, at most ES_MOE_CHUNK */
    float *moe_logits;      /* [moe_cap][n_expert] router logits, then probabilities */
    int32_t *moe_sel;       /* [moe_cap][n_expert_used] chosen experts, in rank order */
    float *moe_w;           /* [moe_cap][n_expert_used] their weights */
    int32_t *moe_slot;      /* [moe_cap][n_expert_used] their slot in the expert-sorted rows */
    int32_t *moe_start;     /* [n_expert + 1] each expert's first slot */
    int32_t *moe_fill;      /* [n_expert] */
    float *moe_x;           /* [moe_cap * n_expert_used][n_embd] the input row of each slot */
    float *moe_g, *moe_u;   /* [moe_cap * n_expert_used][n_ff_exp] gate (then SwiGLU), up */
    float *moe_d;           /* [moe_cap * n_expert_used][n_embd] each slot's expert output */
    void *moe_q8;           /* es_matmul_grouped's scratch for moe_cap * n_expert_used rows, 64-byte aligned */
    int64_t moe_experts_read;   /* experts (gate, up, down) read by the last forward call, over all layers */
    /* token-tree verification (tree.c): the tree of the last call when it was es_forward_tree */
    int32_t tree_n;         /* its nodes in slots [tree_past, tree_past + tree_n); 0: none */
    int32_t tree_past;      /* n_past when it ran */
    int32_t tree_parent[ES_MAX_TREE_NODES];
    char err[256];
};

/* ---- tree.c -------------------------------------------------------------- */

/* A token tree in a forward call (es_forward_tree): node i is row i of the
 * call, its K and V in KV slot n_past + i, its position n_past + depth[i]. */
typedef struct {
    int32_t n;
    const int32_t *parent;  /* [n] parent node, or -1 */
    const int32_t *depth;   /* [n] */
    uint16_t *tail;         /* [pool capacity][2][head_dim * ES_KV_BLOCK] per-thread scratch: a K block
                               (dimension-major) and a V block (position-major) assembled for a node */
} es_tree;

/* The attention of layer l for the tree's rows (s->q in, s->att out; the
 * KV cache holds the rows' keys and values in their slots), on the pool:
 * each node's query over the cached positions, then its ancestors and
 * itself in depth order, block by block as attention.c's contract says. */
void es_tree_attention(es_session *s, const es_tree *t, int l);
/* es_forward over the tree's nodes (forward.c): check_forward_args, RoPE at
 * pos_thw, the attention by es_tree_attention, and at the end no es_kv_advance
 * but the tree recorded on the session (tree_n, tree_past, tree_parent). */
es_status es_forward_tree_run(es_session *s, const int32_t *tokens, const int32_t *pos_thw, const es_tree *t,
                              int32_t *argmax_out, float *logits_out, int32_t logits_mode);

/* Rows of one mixture-of-experts chunk (moe.c): longer calls run in chunks. */
#define ES_MOE_CHUNK 256

/* The mixture-of-experts FFN of layer l over rows [0, n) of s->xb into
 * s->out (moe.c; the contract there). */
void es_moe_ffn(es_session *s, int l, int n);
/* Size the session's moe_* scratch for calls of n rows (nothing for a dense
 * model); ES_ERR_NOMEM with the message on s, the old buffers kept. */
es_status es_moe_scratch(es_session *s, int32_t n);
void es_moe_scratch_free(es_session *s);

/* Sparse attention (sparse.c): the bounds and selection buffers of a
 * session with sparse_topk topk > 0 (ES_ERR_NOMEM with the message; what
 * was allocated is freed by es_sparse_free), and their release. */
es_status es_sparse_alloc(es_session *s, int32_t topk, char *err, size_t err_len);
void es_sparse_free(es_session *s);

/* Make room for n tokens per call (session.c). On failure the old buffers are kept. */
es_status es_session_ensure_scratch(es_session *s, int32_t n);
/* Floats of one attention block result (o padded to 16 floats, then m and l),
 * and of one thread's attention scratch (attention.c). */
int es_attn_part_floats(int hd);
size_t es_attn_ws_floats(int hd, int q_cap);
/* attention.c's block and fold steps, for tree.c: es_attn_block_dense is its
 * block result for nq (<= q_cap) queries qp[j] that attend the block's
 * positions [0, nv[j]) (kb [hd][ES_KV_BLOCK], vb [ES_KV_BLOCK][hd] F16; sc
 * [nq][ES_KV_BLOCK] scratch) into dst[j] (es_attn_part_floats); es_attn_fold
 * folds a block result into a running one (first: a copy); es_attn_finish
 * writes the head's output. */
void es_attn_block_dense(int nq, const float *const *qp, const int *nv, float *const *dst, int hd,
                         const uint16_t *kb, const uint16_t *vb, float *sc, float scale);
void es_attn_fold(float *st, const float *p, int hd, int first);
void es_attn_finish(float *out, const float *st, int hd);

/* ---- helpers ----------------------------------------------------------- */

float es_fp16_to_fp32(uint16_t h);
uint16_t es_fp32_to_fp16(float f);
float es_bf16_to_fp32(uint16_t h);

/* Bytes of memory this process may still take: the environment variable
 * ECHOSPEC_MEM_AVAILABLE when set (bytes, or a number with K, M, G or T;
 * -2 when it is not such a size), else Linux's MemAvailable (which counts
 * the page cache that can be dropped; else the free physical pages), lowered
 * to a cgroup v2 limit's room (a container); -1 when unknown. *source (when
 * source is not NULL) names where the figure came from. */
int64_t es_mem_available(const char **source);

/* ES_OK when `need` bytes fit in es_mem_available(); else ES_ERR_NOMEM with
 * "<what> need(s) <size> but only <size> of memory is available (<source>);
 * <advice>", or ES_ERR_INVALID_ARG naming a malformed ECHOSPEC_MEM_AVAILABLE. */
int es_mem_check(int64_t need, const char *what, const char *advice, char *err, size_t err_len);

/* bytes as "812.0 MiB", "2.31 GiB", ... in buf; returns buf */
const char *es_size_str(double bytes, char buf[32]);

/* Format into a caller buffer (never overflows; NULL buf is a no-op). */
void es_set_err(char *buf, size_t len, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#endif /* ES_INTERNAL_H */
