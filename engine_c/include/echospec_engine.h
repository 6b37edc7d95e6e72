/*
 * echospec_engine.h - the only public header of the echospec C engine.
 *
 * A zero-dependency (libc, libm, pthreads) inference engine for GGUF models
 * of the llama, qwen2, qwen3, qwen3moe, qwen3vl, qwen3vlmoe and gemma3
 * architectures (qwen3vl / qwen3vlmoe / gemma3: the text decoder), built for speculative
 * decoding: one forward call over N new tokens returns the greedy argmax of
 * every position, so prefill, a decode step (N = 1) and the verification of
 * K drafts (N = K + 1) are the same call, and the result of every output
 * element does not depend on N or on the thread count (bitwise).
 *
 * Handles:
 *   es_model    read-only after es_model_load; may be shared by any number
 *               of sessions and threads.
 *   es_session  one KV cache, scratch buffers and a thread pool; used by one
 *               thread at a time.
 *
 * Errors: every fallible call returns an es_status. The detail is kept on
 * the handle (es_session_last_error) or written to the caller's buffer
 * (es_model_load). The library never prints, exits or aborts on bad input.
 *
 * Format: GGUF versions 2 and 3 (ggml's "GGUF" file format: magic, version,
 * tensor count, KV count, KV pairs, tensor infos, aligned tensor data).
 *
 * This header is also the source of the cffi declarations (build_ffi.py
 * reads the part between the ES_CDEF markers), so it keeps to plain C that
 * cffi's parser accepts there: no macros, no inline functions.
 */
#ifndef ECHOSPEC_ENGINE_H
#define ECHOSPEC_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ES_CDEF_BEGIN */

/* Status codes. 0 is success; every other value has a message on the handle. */
typedef enum {
    ES_OK = 0,
    ES_ERR_IO = 1,              /* open, stat or mmap failed */
    ES_ERR_FORMAT = 2,          /* malformed GGUF: the message names the field */
    ES_ERR_UNSUPPORTED = 3,     /* unknown tensor type, architecture or GGUF version */
    ES_ERR_MISSING_TENSOR = 4,  /* a tensor the architecture needs is absent or mis-shaped */
    ES_ERR_INVALID_ARG = 5,     /* bad argument: NULL, token id out of range, n <= 0, ... */
    ES_ERR_CAPACITY = 6,        /* the KV cache of the session would overflow */
    ES_ERR_NOMEM = 7,           /* allocation failed */
    ES_ERR_INTERNAL = 8,        /* a thread could not be started, or a broken invariant */
    ES_ERR_BAD_WEIGHTS = 9      /* a weight is NaN or infinite (at load: the message names the
                                   tensor and block), or a forward's logits row holds a NaN */
} es_status;

typedef struct es_model es_model;
typedef struct es_session es_session;

/* Model load parameters; get the defaults from es_model_default_params(). */
/* es_model_params.flags */
#define ES_MODEL_NO_REPACK 1    /* keep the weights as mapped: no repacked copy (a load to
                                   validate a file or read its metadata; forward passes then use
                                   the scalar kernels for Q4_0 / Q4_1 / Q8_0, much slower) */
#define ES_MODEL_CHECK_WEIGHTS 2 /* the full check at load: besides the scales and float tensors
                                   (always checked), decode every value of every quantized tensor
                                   and check it is finite */

typedef struct {
    int32_t flags;              /* ES_MODEL_* bits; others must be 0 */
} es_model_params;

/* Hyperparameters of a loaded model, as read from the GGUF metadata. */
typedef struct {
    char arch[16];              /* "llama", "qwen2", "qwen3", "qwen3moe", "qwen3vl", "qwen3vlmoe" or
                                   "gemma3" */
    int32_t n_vocab;            /* tokens */
    int32_t n_ctx_train;        /* tokens the model was trained for */
    int32_t n_embd;             /* hidden size */
    int32_t n_layer;            /* transformer blocks */
    int32_t n_head;             /* query heads */
    int32_t n_head_kv;          /* key/value heads (GQA when < n_head) */
    int32_t head_dim;           /* per-head size of q and k (attention.key_length) */
    int32_t n_ff;               /* FFN hidden size (SwiGLU; gemma3: GELU-gated) */
    float rope_freq_base;       /* RoPE theta */
    int32_t rope_dim;           /* rotated dimensions per head (<= head_dim) */
    int32_t rope_neox;          /* 1: pairs (i, i + rope_dim/2) (qwen2/3); 0: pairs (2i, 2i+1) (llama) */
    float norm_eps;             /* RMSNorm epsilon */
    int32_t tied_output;        /* 1 when output.weight is absent and token_embd is reused */
    int64_t weight_bytes;       /* bytes of tensor data read per decode step (mixture of experts:
                                   with n_expert_used of the n_expert experts of each layer) */
    int64_t file_weight_bytes;  /* bytes of all the tensor data the forward pass uses */
    int32_t n_expert;           /* experts per layer (mixture of experts), 0 when dense */
    int32_t n_expert_used;      /* experts each token runs (top-k of the router), 0 when dense */
    int32_t n_ff_exp;           /* SwiGLU hidden size of one expert, 0 when dense */
    int32_t rope_sections[4];   /* multimodal RoPE (qwen3vl*): rotation pairs of t, h, w and the
                                   4th section, interleaved (pair j: h when j % 3 == 1 and
                                   j < 3 * sections[1], w when j % 3 == 2 and j < 3 * sections[2],
                                   else t); all 0 for plain RoPE */
    int32_t n_deepstack;        /* qwen3vl*: layers that add the vision tower's deepstack
                                   features (kept for images; text adds nothing), else 0 */
    int32_t n_swa;              /* gemma3: sliding window of the local layers (a query at position p
                                   attends (p - n_swa, p]), 0 when every layer is global */
    int32_t n_swa_layers;       /* layers with the sliding window (the others attend every position) */
    float rope_freq_base_swa;   /* RoPE theta of the sliding-window layers (gemma3) */
    float rope_freq_scale;      /* RoPE position scale of the global layers (1 / linear scaling factor;
                                   1 when the file has none) */
} es_model_info;

/*
 * Session parameters; get the defaults from es_session_default_params().
 *
 * The KV cache of a model with a sliding window (gemma3's local layers, es_model_info.n_swa):
 * a global layer keeps every position, n_ctx rounded up to a multiple of 64; a local layer
 * keeps a ring of C = min(that, round_up(n_swa + swa_slack, 64)) positions, position p at
 * slot p % C, so its memory follows the window, not n_ctx. The slack is what the ring holds
 * beyond the window: how far back a session can roll (es_session_min_rollback: at least
 * swa_slack positions back from the furthest position written) and the most tokens one
 * forward piece writes (a longer es_forward is run in pieces of swa_slack tokens, with the
 * same results bitwise). swa_full keeps every position in every layer (any rollback, more
 * memory). Results are bitwise the same in both layouts.
 *
 * KV eviction (StreamingLLM's attention sinks plus a recent window; kv_window > 0): in every
 * layer a query at position p attends positions [0, S) U (p - W, p] (S = kv_sinks, W =
 * kv_window) and nothing else. A layer keeps ceil(S / 64) blocks of sinks (positions [0,
 * 64 * ceil(S / 64)), never overwritten) plus a ring of R = round_up(W + swa_slack, 64)
 * positions for the rest, position p at slot (p - 64 * ceil(S / 64)) % R of the ring:
 * 2 * n_layer * (64 * ceil(S / 64) + R) * n_head_kv * head_dim * 2 bytes whatever the
 * generation's length (es_session_kv_bytes); swa_slack is also the most tokens one forward
 * piece writes here, so W need not exceed it. n_ctx then bounds nothing:
 * a session runs past it (up to ES_EVICT_MAX_POS). Positions stay absolute: each key is
 * rotated (RoPE) once, at its own position, when it is written, and a query at p rotates by
 * p, so a kept sink at position 0 is p positions away from it (StreamingLLM instead renumbers
 * the cached positions, which would mean rotating every cached key again at every step and
 * would make a result depend on what the cache held, not on the query's position; absolute
 * positions keep every output element a function of its own position, the contract below).
 * Rollback and forward pieces work as for the rings above (es_session_min_rollback). Not
 * on a model with sliding-window layers (ES_ERR_UNSUPPORTED).
 *
 * Sparse attention (sparse_topk K > 0; Quest-style, for decode at long context): a call of
 * up to 8 tokens (decode, verify) at positions [n_past, n_past + n) attends, in every global
 * layer and per KV head, block 0 (positions [0, 64), the sink), the blocks holding positions
 * n_past + n - 1 and the 64 before it (the recent ones), and the K other blocks of the
 * largest upper bound of q . k: per block the element-wise min and max of its keys (kept as
 * keys are written), bound = sum over dimensions d of max(q_d * min_d, q_d * max_d), summed
 * over the KV head's query heads, for the query of the call's last token; ties go to the
 * lower block. Every query of the call sees those blocks (up to its own position). Only
 * when the context has more than K + 3 blocks; longer calls (prefill) and sliding-window
 * layers stay dense, as does everything when K covers every block (bitwise a session
 * without it). Deterministic and independent of the thread count and SIMD path, but a
 * query's result depends on the call it is in (the choice is the call's), so an n-token
 * verify is not n single steps: speculation is not exact with it (the services refuse
 * speculation under sparse attention). Not with KV eviction (ES_ERR_UNSUPPORTED).
 */
typedef struct {
    int32_t n_ctx;              /* KV capacity in tokens; 0 = min(n_ctx_train, 4096) */
    int32_t n_threads;          /* worker threads incl. the caller; 0 = all online cores */
    int32_t swa_slack;          /* sliding-window layers: positions kept beyond the window,
                                   in [1, ES_MAX_CTX]; 0 = ES_SWA_SLACK */
    int32_t swa_full;           /* 1: sliding-window layers keep all n_ctx positions (llama.cpp's
                                   swa_full); 0: a ring (the default) */
    int32_t kv_sinks;           /* KV eviction: the first kv_sinks positions (attention sinks),
                                   in [0, ES_MAX_CTX]; 0 when kv_window is 0 */
    int32_t kv_window;          /* KV eviction: the most recent kv_window positions, in [1, ES_MAX_CTX]
                                   (kv_sinks + kv_window <= ES_MAX_CTX); 0: no eviction (the default) */
    int32_t sparse_topk;        /* sparse attention: blocks chosen by the bound beside the sink and
                                   recent ones, in [1, ES_MAX_SPARSE_TOPK]; 0: dense (the default) */
    int32_t kv_type;            /* the KV cache's element type (es_kv_type): ES_KV_F16 (the default)
                                   or ES_KV_Q8_0 */
} es_session_params;

/*
 * KV cache element types (es_session_params.kv_type).
 *   ES_KV_F16   IEEE binary16, float32 rounded to nearest even: 2 bytes a value.
 *   ES_KV_Q8_0  ggml's Q8_0 per position and KV head: each run of 32 values of a key (or value)
 *               vector, dimensions [32j, 32j + 32), is one block of an F16 scale d = amax / 127
 *               (amax: the largest |x| of the 32) and 32 int8 q = roundf(x / d) (ties away
 *               from zero; 0 when amax is 0), read back as q * d: 34 bytes per 32 values, 0.53
 *               of F16's 64. Quantized once, when a position is written, by one scalar
 *               function on every target; q * d is exact in float32, so the attention reads
 *               the same floats on every SIMD path. A call's own tokens are read back from the
 *               quantized cache like every earlier position, so a verify of n tokens is
 *               bitwise n single decode steps here too. Needs head_dim a multiple of 32
 *               (ES_ERR_UNSUPPORTED otherwise). Quality: see README.md, "KV cache type".
 */
typedef enum {
    ES_KV_F16 = 0,
    ES_KV_Q8_0 = 1
} es_kv_type;

/* The range of es_session_params es_session_new accepts (the Python side and the CLI read
 * them from here, through cffi's lib.ES_MIN_CTX and lib.ES_MAX_*), and the default slack. */
enum {
    ES_MIN_CTX = 16,            /* n_ctx, tokens (0, the default, is exempt) */
    ES_MAX_CTX = 1 << 20,       /* n_ctx, tokens */
    ES_MAX_THREADS = 256,       /* n_threads */
    ES_SWA_SLACK = 256,         /* swa_slack when 0: a verify of up to 255 drafts rolls back */
    ES_EVICT_MAX_POS = 1 << 30, /* KV eviction: the positions a session may reach (n_ctx does not
                                   bound it) */
    ES_MAX_SPARSE_TOPK = 16384          /* sparse_topk: the blocks of ES_MAX_CTX (2^20 / 64) */
};

/* Sampling parameters for requests that are not greedy. */
typedef struct {
    float temperature;          /* <= 0: greedy argmax (the other fields are ignored) */
    int32_t top_k;              /* <= 0: off */
    float top_p;                /* >= 1: off */
    float min_p;                /* <= 0: off */
} es_sampler_params;

es_model_params es_model_default_params(void);
es_session_params es_session_default_params(void);

/*
 * Load a GGUF model from `path` (mmap'd read-only).
 * On success *out is a model handle (free with es_model_free) and ES_OK is
 * returned. On failure *out is NULL, the status says what class of error it
 * was, and a NUL-terminated message naming the offending field is written to
 * err[0..err_len) when err is not NULL. Every count, length, dimension,
 * offset and type from the file is checked against the file size and for
 * overflow before use.
 * Memory: builds with a packed SIMD kernel (AVX-512, AVX2, NEON dotprod)
 * copy every 2-D Q4_0 / Q4_1 / Q8_0 tensor into a repacked layout (16 rows
 * interleaved; the same bytes as the tensor) and release the mapped pages
 * of those tensors, so the weights are resident once (SmolLM2-135M Q4_1:
 * about 97 MB after load). The copies share one 2 MiB-aligned allocation,
 * advised as transparent huge pages on Linux (MADV_HUGEPAGE; ignored where
 * THP is off). ES_ERR_NOMEM when that copy can not be made.
 * Mixture-of-experts files repack each expert's matrices the same way. The
 * copy is refused with ES_ERR_NOMEM, before anything is allocated, when it
 * exceeds the memory available (Linux MemAvailable, lowered to a cgroup v2
 * limit's room; the environment variable ECHOSPEC_MEM_AVAILABLE, in bytes or
 * with a K, M, G or T suffix, overrides both), with a message giving both
 * sizes and where the available figure came from. A malformed
 * ECHOSPEC_MEM_AVAILABLE gives ES_ERR_INVALID_ARG naming it.
 * params->flags ES_MODEL_NO_REPACK skips the copy. params may be NULL
 * (defaults); unknown flag bits give ES_ERR_INVALID_ARG.
 * Weights check: every tensor's block scales (the f16 d, and dmin / m where
 * the type has one: Q4_0 ... Q6_K) and every value of an F32, F16 or BF16
 * tensor must be finite, else ES_ERR_BAD_WEIGHTS with a message naming the
 * tensor, the block (or element) and the value. A quantized value is its
 * scale times a small integer (minus dmin times one), so finite scales make
 * every value finite; this check reads the scales only (one pass over the
 * file's pages, which the load reads anyway). ES_MODEL_CHECK_WEIGHTS also decodes every value of every
 * quantized tensor and checks each one (slower: a full pass of dequantization).
 */
es_status es_model_load(const char *path, const es_model_params *params,
                        es_model **out, char *err, size_t err_len);

/* Free a model. Sessions created from it must be freed first. NULL is a no-op. */
void es_model_free(es_model *model);

/* Copy the model's hyperparameters into *info. */
es_status es_model_get_info(const es_model *model, es_model_info *info);

/*
 * Create a session (one KV sequence) on `model`.
 * Returns ES_ERR_INVALID_ARG for n_ctx other than 0 outside [ES_MIN_CTX, ES_MAX_CTX], n_threads < 0
 * or n_threads > ES_MAX_THREADS, swa_slack outside [0, ES_MAX_CTX], swa_full other than 0 or 1,
 * kv_sinks outside [0, ES_MAX_CTX], kv_window outside [0, ES_MAX_CTX], kv_sinks > 0 with
 * kv_window 0, kv_sinks + kv_window > ES_MAX_CTX (the message names the field),
 * kv_type not an es_kv_type,
 * ES_ERR_UNSUPPORTED for kv_window > 0 on a model with sliding-window layers, and for kv_type
 * ES_KV_Q8_0 on a model whose head_dim is not a multiple of 32,
 * ES_ERR_NOMEM when the KV cache (IEEE float16: 2 * (global layers * n_ctx rounded up to 64 +
 * sliding-window layers * C) * n_head_kv * head_dim * 2 bytes, C as above es_session_params;
 * with eviction as there; Q8_0: 34 / 32 bytes a value instead of 2; es_session_kv_bytes) cannot
 * be allocated or exceeds the memory available (as es_model_load counts it;
 * refused before anything is mapped; ES_ERR_INVALID_ARG for a malformed
 * ECHOSPEC_MEM_AVAILABLE),
 * ES_ERR_INTERNAL when a worker thread cannot be started. On failure *out is
 * NULL and a message goes to err (like es_model_load).
 */
es_status es_session_new(const es_model *model, const es_session_params *params,
                         es_session **out, char *err, size_t err_len);

/* Free a session, its KV cache and its threads. NULL is a no-op. */
void es_session_free(es_session *session);

/*
 * Let the session's next calls (es_forward, es_forward_last, and the
 * es_forward_batch calls that run on its pool) use n_threads of its pool's
 * threads, the caller included: n_threads in [1, the pool's size] (the
 * n_threads it was created with, or the online cores for 0); the pool's
 * other workers sleep. A new session uses its whole pool. Results are
 * bitwise the same whatever the count (the engine's contract); only the
 * speed changes. Call it between calls, from the thread that owns the
 * session.
 * Errors: ES_ERR_INVALID_ARG when session is NULL or n_threads is out of
 * range (the message on the session; the count is then unchanged).
 */
es_status es_session_set_threads(es_session *session, int32_t n_threads);

/* Threads the session's next call uses (es_session_set_threads); 0 for NULL. */
int32_t es_session_threads(const es_session *session);

/* Threads of the session's pool, fixed at es_session_new; 0 for NULL. */
int32_t es_session_pool_threads(const es_session *session);

/* Positions held in the KV cache (tokens). */
int32_t es_session_n_past(const es_session *session);

/* KV capacity (tokens): n_ctx (with KV eviction, what es_session_new was given; it bounds nothing). */
int32_t es_session_n_ctx(const es_session *session);

/* Bytes of the session's KV cache (K and V of every layer), as allocated at es_session_new:
 * the sliding-window layers' rings counted at their size (es_session_params); 0 for NULL. */
size_t es_session_kv_bytes(const es_session *session);

/* The smallest n_past > 0 es_session_rollback can reach now, or 0 when it can reach any.
 * Not 0 only on a model with a sliding window whose rings have wrapped: the next token's
 * window must still be in them, so a rollback can go back to the furthest position written
 * less C - n_swa + 1 >= swa_slack + 1; with KV eviction, once the ring has wrapped: the
 * furthest position written less R - kv_window + 1 (a session that evicted positions can not
 * go back before them). Rollback to 0 (a reset) always works. 0 for NULL. */
int32_t es_session_min_rollback(const es_session *session);

/* Sparse attention, for tests and diagnostics: the blocks (absolute, ascending) KV head
 * kv_head of layer `layer` attended in the session's last call, into blocks[0, *n_out);
 * *n_out = 0 when that call's attention there was dense (or sparse_topk is 0). The call's
 * queries each saw those up to their own position. ES_ERR_INVALID_ARG with a message for
 * NULL n_out, a layer or head out of range, or more blocks than cap. */
es_status es_session_sparse_blocks(es_session *session, int32_t layer, int32_t kv_head, int32_t *blocks,
                                   int32_t cap, int32_t *n_out);

/* Message of the last failed call on this session ("" if none). Valid until the next call. */
const char *es_session_last_error(const es_session *session);

/* Expert matrices (one expert's gate, up and down count as one) that the
 * session's last forward call read, summed over the layers; 0 for a dense
 * model. A call over K + 1 rows reads the union of the experts its rows
 * chose, once (the batch's runner session counts a batch's). */
int64_t es_session_experts_read(const es_session *session);

/*
 * Truncate the KV cache to its first n_past positions (the half-open range
 * [n_past, old n_past) is removed). Exact: a later forward gives bitwise the
 * same results as if the removed positions had never been written.
 * Errors: ES_ERR_INVALID_ARG when n_past < 0, n_past > current n_past, or
 * 0 < n_past < es_session_min_rollback (the sliding-window layers' rings no
 * longer hold the window position n_past attends; the message says how far back
 * the session can go); the KV cache is then unchanged.
 */
es_status es_session_rollback(es_session *session, int32_t n_past);

/* logits_mode of es_forward and es_batch_item: which logits rows are written. */
enum {
    ES_LOGITS_NONE = 0,         /* none (the argmax only) */
    ES_LOGITS_LAST = 1,         /* the last position's (or head row's) row */
    ES_LOGITS_ALL = 2           /* every position's (or head row's) row */
};

/*
 * Run the model over n_tokens new tokens at positions [n_past, n_past + n_tokens)
 * and append them to the KV cache.
 *
 *   tokens      int32[n_tokens], each in [0, n_vocab)
 *   argmax_out  int32[n_tokens] or NULL: greedy next token after each position
 *               (ties go to the lowest id)
 *   logits_out  float32[n_logits_rows * n_vocab] or NULL
 *   logits_mode ES_LOGITS_NONE (0): no logits; ES_LOGITS_LAST (1): the last
 *               position's row only (n_logits_rows = 1); ES_LOGITS_ALL (2):
 *               every position (n_logits_rows = n_tokens)
 *
 * With ES_LOGITS_NONE the argmax is taken from the output projection chunk by
 * chunk while each chunk is in cache, and no logits row is written anywhere;
 * the result is the same as the argmax of the logits the other modes return.
 * The weights are read once per call, not once per token. Each output element
 * is computed by the same sequence of floating-point operations whatever
 * n_tokens and the thread count are, so one call over N tokens is bitwise
 * equal to N calls over one token. On a session whose sliding-window layers
 * keep a ring (es_session_params), a call over more than swa_slack tokens runs
 * as consecutive pieces of swa_slack tokens (what that equality makes exact).
 *
 * Errors: ES_ERR_INVALID_ARG (n_tokens <= 0, a token out of range, bad
 * logits_mode), ES_ERR_CAPACITY (n_past + n_tokens > n_ctx; with KV eviction
 * n_past + n_tokens > ES_EVICT_MAX_POS), ES_ERR_BAD_WEIGHTS
 * when a logits row the call computes holds a NaN (whatever logits_mode: the row
 * has no argmax, so none is made up; the message names the position). On any
 * error the KV cache is unchanged (n_past as before the call; after a NaN in a
 * call run in pieces, as far back as the rings reach, es_session_min_rollback).
 */
es_status es_forward(es_session *session, const int32_t *tokens, int32_t n_tokens,
                     int32_t *argmax_out, float *logits_out, int32_t logits_mode);

/*
 * es_forward with the rotary positions given: pos_thw int32[n_tokens][3]
 * holds each token's (t, h, w) position of the multimodal RoPE (qwen3vl,
 * qwen3vlmoe; es_model_info.rope_sections), or is NULL for t = h = w = the
 * token's KV position, which is es_forward (text). Models without sections
 * rotate by t. The KV cache, the attention's causal order and the outputs
 * are as es_forward's; a call with pos_thw (p, p, p) for each KV position p
 * is bitwise es_forward.
 * Errors: as es_forward, and ES_ERR_INVALID_ARG for a negative position.
 */
es_status es_forward_positions(es_session *session, const int32_t *tokens, int32_t n_tokens,
                               const int32_t *pos_thw, int32_t *argmax_out, float *logits_out,
                               int32_t logits_mode);

/* A token value of es_forward_embd: the row takes the next given embedding as its input. */
enum { ES_TOKEN_EMBD = -1 };

/*
 * es_forward_positions with some rows' inputs given as embeddings (image tokens): a row whose
 * token is ES_TOKEN_EMBD takes the next row of embd (float32 [n_embd_rows][n_embd], the text
 * model's width, e.g. es_vision_encode's output) instead of a token embedding; the count of
 * such rows must be n_embd_rows. deepstack: float32 [n_deepstack][n_embd_rows][n_embd] or NULL
 * (n_deepstack 0): after text layer l < n_deepstack, row j of layer l's slab is added to the
 * hidden state of the j-th embedding row, as Qwen3-VL adds its deepstack features. pos_thw as
 * es_forward_positions (an image's (t, h, w) grid positions). Other rows, the KV cache and the
 * outputs are as es_forward_positions'; a call without ES_TOKEN_EMBD rows is bitwise it.
 * Errors: as es_forward_positions; ES_ERR_INVALID_ARG when the ES_TOKEN_EMBD count differs
 * from n_embd_rows, embd is NULL with rows, n_deepstack is outside [0, n_layer] or does not
 * agree with deepstack being NULL; ES_ERR_UNSUPPORTED for deepstack on a model with FFN
 * post-norms (gemma3).
 */
es_status es_forward_embd(es_session *session, const int32_t *tokens, int32_t n_tokens,
                          const int32_t *pos_thw, const float *embd, int32_t n_embd_rows,
                          const float *deepstack, int32_t n_deepstack,
                          int32_t *argmax_out, float *logits_out, int32_t logits_mode);

/*
 * es_forward for prefill: the same pass over n_tokens new tokens, but the
 * output head (final norm, output projection, argmax) runs on the last
 * position only, which saves n_tokens - 1 rows of the largest matmul.
 *   argmax_last  int32[1] or NULL: greedy token after the last position
 *   logits_last  float32[n_vocab] or NULL: the last position's logits
 * The last row's results are bitwise those es_forward gives for it.
 * Errors and the KV cache after failure: as es_forward.
 */
es_status es_forward_last(es_session *session, const int32_t *tokens, int32_t n_tokens,
                          int32_t *argmax_last, float *logits_last);

/* Nodes of an es_forward_tree call, at most. */
enum { ES_MAX_TREE_NODES = 64 };

/*
 * Verify a token tree in one forward pass. Node i (tokens[i], in
 * [0, n_vocab)) follows node parents[i], or the last cached position when
 * parents[i] is -1 (a root; a tree may have several); parents precede
 * children (parents[i] in [-1, i)), so no cycle can be written. Node i sits
 * at position n_past + depth(i) (depth: 0 for a root, its parent's + 1), is
 * rotated (RoPE) by that position, and attends the cached positions [0,
 * n_past) and its ancestors, root first, then itself: the keys the last row
 * of es_forward over its root-to-node path would attend, in the same order
 * and 64-position blocks. So node i's argmax and logits are bitwise those of
 * es_forward over that path (and of its tokens one by one), whatever n_nodes,
 * the other nodes and the thread count. The weights are read once for all
 * the nodes.
 *   tokens      int32[n_nodes]
 *   parents     int32[n_nodes]
 *   n_nodes     in [1, ES_MAX_TREE_NODES]; a chain (parents[i] = i - 1) is the
 *               tree of width 1
 *   argmax_out  int32[n_nodes] or NULL: greedy next token after each node
 *   logits_out  float32[n_logits_rows * n_vocab] or NULL, logits_mode as
 *               es_forward's over the nodes (ES_LOGITS_LAST: node n_nodes - 1)
 * The KV cache: n_past does not move. The nodes' K and V are kept in the
 * slots [n_past, n_past + n_nodes) (node i in slot n_past + i) until the next
 * call on the session: es_session_keep_path then keeps one path of them;
 * any other forward call (or a rollback below n_past) drops them.
 * Supported: the sessions es_forward serves but KV eviction (kv_window > 0),
 * sparse attention (sparse_topk > 0), a Q8_0 KV cache (kv_type ES_KV_Q8_0) and models
 * with sliding-window layers (es_model_info.n_swa_layers > 0): ES_ERR_UNSUPPORTED with a message.
 * Errors: as es_forward's (ES_ERR_CAPACITY when n_past + n_nodes > n_ctx,
 * the slots it needs), and ES_ERR_INVALID_ARG with a message for n_nodes
 * outside [1, ES_MAX_TREE_NODES], NULL parents, or a parent that is not -1
 * or an earlier node. On any error the KV cache is unchanged (n_past as
 * before, no tree to keep a path of).
 */
es_status es_forward_tree(es_session *session, const int32_t *tokens, const int32_t *parents, int32_t n_nodes,
                          int32_t *argmax_out, float *logits_out, int32_t logits_mode);

/*
 * Keep one root-to-node path of the tree the session's last call verified
 * (es_forward_tree): nodes[0 .. n_path) are node indices, nodes[0] a root
 * (parent -1) and nodes[j] a child of nodes[j - 1]. Node nodes[j]'s K and V
 * move to position n_past + j, the other nodes are dropped, and n_past
 * advances by n_path: the KV cache is then bitwise that of es_forward over
 * the path's tokens (n_path 0 keeps nothing and drops the tree). Either way
 * the tree is gone after the call.
 * Errors: ES_ERR_INVALID_ARG with a message when the session's last call was
 * not an es_forward_tree that succeeded (or the session rolled back since),
 * n_path < 0 or more than the tree's nodes, nodes NULL with n_path > 0, a
 * node out of range, or a node that is not a child of the one before (a
 * first node that is not a root); the KV cache and the tree are then
 * unchanged.
 */
es_status es_session_keep_path(es_session *session, const int32_t *nodes, int32_t n_path);

/*
 * Greedy decoding in the engine: up to max_steps single-token steps, each
 * fed the previous step's argmax, without returning to the caller between
 * them. Step i runs es_forward over one token (token for step 0, then
 * tokens_out[i - 1]) and writes its greedy next token to tokens_out[i];
 * each step is bitwise that es_forward call, so the tokens are those of
 * max_steps calls made one by one.
 *   stop_ids   int32[n_stop] (NULL when n_stop is 0): the run ends after a
 *              step whose token is one of them (EOS), the token included
 *   interrupt  NULL, or an int32 another thread may set while the run goes
 *              on: when it is not 0 after a step, the run ends there (a
 *              scheduler that has other work, a cancelled request). At
 *              least one step runs whatever its value.
 *   tokens_out int32[max_steps]
 *   ms_out     float32[max_steps] or NULL: each step's wall time (ms)
 *   n_out      out: the steps done, also on error
 * After the run the KV cache holds token and tokens_out[0 .. n_out - 2]:
 * the last token has not been fed yet (it is the next call's token).
 * Errors: ES_ERR_INVALID_ARG (max_steps < 1, n_stop < 0, a NULL array it
 * needs, token out of range), ES_ERR_CAPACITY (n_past + max_steps > n_ctx;
 * with KV eviction > ES_EVICT_MAX_POS),
 * both before any step; an error of step i (as es_forward's) ends the run
 * with n_out = i and the KV cache as after step i - 1.
 */
es_status es_decode(es_session *session, int32_t token, int32_t max_steps, const int32_t *stop_ids,
                    int32_t n_stop, const int32_t *interrupt, int32_t *tokens_out, float *ms_out,
                    int32_t *n_out);

/* The arguments and results of es_verify_run (the caller's memory). */
typedef struct {
    int32_t token;              /* the pending token: the output's last, not yet in the KV cache */
    const int32_t *drafts;      /* int32[n_drafts]: the expected continuation after token */
    int32_t n_drafts;           /* >= 1 */
    int32_t k;                  /* most drafts a round verifies, >= 1 */
    int32_t max_out;            /* most tokens the run yields, >= 2 */
    double max_ms;              /* no round starts once the run has taken this long (<= 0: no limit) */
    const int32_t *stop_ids;    /* int32[n_stop] or NULL when n_stop is 0 */
    int32_t n_stop;
    const int32_t *interrupt;   /* NULL or an int32 another thread may set: no round starts then */
    int32_t *tokens_out;        /* int32[n_max]: every round's accepted drafts, then its bonus token */
    int32_t *round_k;           /* int32[n_max]: each round's drafts verified */
    int32_t *round_r;           /* int32[n_max]: each round's drafts accepted */
    float *ms_out;              /* float32[n_max] or NULL: each round's forward (ms) */
    float *rollback_ms_out;     /* float32[n_max] or NULL: each round's KV rollback (ms; 0: none)
                                   (n_max = min(max_out, n_drafts + 1, n_ctx - n_past): a run writes
                                   at most that many tokens, and fewer rounds) */
    int32_t n_rounds;           /* out: rounds done, also on error */
    int32_t n_out;              /* out: tokens written, also on error */
    int32_t n_past_in;          /* out: the KV cache's n_past when the call began (-1: no session),
                                   where a caller rolls back to after an error */
} es_verify_run_args;

/*
 * Speculative rounds over a known draft sequence without returning to the caller between them:
 * the caller's verify loop, run in the engine while every draft is kept. Round j verifies
 * [pending] + drafts[pos, pos + k_j) with one es_forward (ES_LOGITS_NONE; pending is token,
 * pos 0 in round 0), where k_j = min(k, n_drafts - pos, max_out - tokens so far - 1,
 * n_ctx - n_past - 1); it keeps the longest prefix R of those drafts equal to the argmax after
 * the token before each (greedy decoding's own tokens), rolls the KV cache back over the
 * k_j - R rejected positions (es_session_rollback) and yields drafts[pos, pos + R) then the
 * bonus token, the argmax after the last kept one. The next round runs only when this one kept
 * every draft, its bonus is the next draft (drafts[pos + k_j]: the sequence still continues
 * the output), at least k drafts follow that one (a shorter rest is left to the caller, who may
 * draft more after it), no yielded token is one of stop_ids, the next round has room for a draft, the
 * run has taken less than max_ms and *interrupt is 0; the bonus is then its pending token and
 * pos moves past it. Each round is bitwise the es_forward call and rollback the caller would
 * make, so the tokens and the KV cache are those of that loop, whatever k, the thread count and
 * where the run stops. After the run the KV cache holds token and every yielded token but the
 * last (the next call's pending token), as after es_decode.
 * Errors: ES_ERR_INVALID_ARG with a message (args NULL, n_drafts < 1, k < 1, max_out < 2,
 * n_stop < 0, a NULL array it needs, a token or draft out of range, no room for a round of one
 * draft in n_ctx; on a session whose sliding-window rings wrap, a round that could verify more
 * than ring - n_swa >= swa_slack drafts, min(k, n_drafts, max_out - 1, n_ctx - n_past - 1): its
 * rollback might be out of the rings' reach, es_session_min_rollback), ES_ERR_UNSUPPORTED for a session with KV eviction or sparse attention (the
 * services never speculate there), both before any round; a round's own error (as
 * es_forward's) ends the run with n_rounds and n_out those of the rounds before it and the KV
 * cache as after them.
 */
es_status es_verify_run(es_session *session, es_verify_run_args *args);

/* One session's part of an es_decode_batch call (es_decode's arguments). */
typedef struct {
    es_session *session;
    int32_t token;              /* the first step's token */
    int32_t max_steps;          /* >= 1; n_past + max_steps <= n_ctx */
    const int32_t *stop_ids;    /* int32[n_stop] or NULL when n_stop is 0 */
    int32_t n_stop;
    int32_t *tokens_out;        /* int32[max_steps] */
    int32_t n_out;              /* out: this session's steps done */
    es_status status;           /* out: this session's result */
} es_decode_item;

/*
 * es_decode for several sessions at once: each step is one es_forward_batch
 * over the sessions still decoding (one token each, fed its own last
 * argmax), so the weights are read once per step for all of them, and each
 * session's tokens are bitwise what es_decode gives it alone. A session
 * leaves the run after a token of its stop_ids or its max_steps; the run
 * ends when none is left, or after a step when *interrupt is not 0 (at
 * least one step runs). ms_out: float32[the largest max_steps] or NULL, the
 * wall time of each step of the run; *n_steps (out, may be NULL): the
 * run's steps.
 * Errors: an item with bad arguments (as es_decode's) or a step that fails
 * for it fails alone, with its status and n_out set and its KV cache as
 * after its last step done; the others go on. Returns ES_OK when every item
 * succeeded, else the first item's failure; ES_ERR_INVALID_ARG for
 * items NULL or n_items outside [1, ES_MAX_BATCH] (nothing runs).
 */
es_status es_decode_batch(es_decode_item *items, int32_t n_items, const int32_t *interrupt, float *ms_out,
                          int32_t *n_steps);

/* es_batch_item.head: the rows the output head runs on. */
enum {
    ES_HEAD_ALL = 0,            /* every position, as es_forward */
    ES_HEAD_LAST = 1            /* the last position only, as es_forward_last */
};

/* Sessions per es_forward_batch call, at most. */
enum { ES_MAX_BATCH = 64 };

/* One session's part of an es_forward_batch call: its inputs, its outputs
 * (the caller's memory) and its status. */
typedef struct {
    es_session *session;
    const int32_t *tokens;      /* int32[n_tokens], each in [0, n_vocab) */
    int32_t n_tokens;           /* >= 1 */
    int32_t head;               /* ES_HEAD_ALL or ES_HEAD_LAST: head rows = n_tokens or 1 */
    int32_t *argmax_out;        /* int32[head rows] or NULL */
    float *logits_out;          /* float32[n_logits_rows * n_vocab] or NULL */
    int32_t logits_mode;        /* as es_forward, over the head rows: ES_LOGITS_NONE,
                                   ES_LOGITS_LAST (the last head row), ES_LOGITS_ALL */
    es_status status;           /* out: this session's result */
} es_batch_item;

/*
 * One forward pass over several sessions of one model: item i appends its
 * n_tokens tokens to its own session at positions [n_past_i, n_past_i +
 * n_tokens), as es_forward (head ES_HEAD_ALL) or es_forward_last
 * (ES_HEAD_LAST) would, and writes its argmax and logits the same way.
 *
 * The rows of all items go through every matmul together, so each weight
 * block is read once for the whole batch; RoPE, the KV append and the
 * attention run per session on its own KV cache and positions. Each item's
 * results are bitwise what es_forward / es_forward_last give for its session
 * alone, whatever the other items, their order and the thread count.
 *
 * The call runs on the thread pool and scratch of the first item that
 * passes its checks (that session's scratch grows to the batch's total
 * tokens), with that session's thread count (es_session_set_threads; the
 * other sessions' counts do not matter), and it owns every session of the
 * batch for its duration, as
 * es_forward owns one: the caller keeps other threads off all of them.
 *
 * Errors, per item (items[i].status, the message on its session): every
 * error es_forward gives, and ES_ERR_INVALID_ARG for a NULL session (no
 * message), a head other than ES_HEAD_ALL / ES_HEAD_LAST, a session on
 * another model than the first non-NULL session's, or a session that
 * appears in more than one item (all of them fail). A failed item does not
 * run and its KV cache is unchanged; the other items run. ES_ERR_NOMEM (the
 * batch's scratch could not be allocated) fails every item that passed its
 * checks, and none runs.
 * Returns ES_OK when every item succeeded, else the status of the first item
 * that failed; ES_ERR_INVALID_ARG, touching nothing, when items is NULL or
 * n_items is not in [1, ES_MAX_BATCH].
 */
es_status es_forward_batch(es_batch_item *items, int32_t n_items);

/*
 * Draw one token from a logits row (float32[n_vocab]). Filters apply in
 * llama.cpp's default order: top_k, then top_p (nucleus, Holtzman et al.
 * 2019) and min_p on the softmax of the raw logits, then temperature; the
 * token is drawn from the softmax of the kept logits / temperature, using
 * and advancing the caller's 64-bit RNG state (xorshift64*; seed it with any
 * nonzero value; 0 is replaced by a fixed constant). Same state, same logits,
 * same token. Greedy (temperature <= 0) returns the first index of the
 * largest logit (+inf allowed) and leaves *rng unchanged.
 * Errors: returns -1 when logits or rng is NULL, n_vocab <= 0, a parameter
 * (temperature, top_p, min_p) is NaN, a logit is NaN (greedy or sampling),
 * or, when sampling (temperature > 0), a logit is +inf or every logit is
 * -inf. (es_forward's argmax differs on NaN: it never picks a NaN after the
 * first logit and gives 0 when the first is NaN.)
 */
int32_t es_sample(const float *logits, int32_t n_vocab, const es_sampler_params *params,
                  uint64_t *rng);

/* The name of the SIMD path this build uses: "avx512", "avx2", "neon-dotprod", "neon" or "scalar". */
const char *es_simd_name(void);

/* ---- vision encoder (Qwen3-VL projector GGUF) ----------------------------------------------
 *
 * es_vision: the Qwen3-VL vision encoder read from a projector GGUF (general.architecture "clip",
 * clip.projector_type "qwen3vl_merger", as llama.cpp's converter writes it with --mmproj):
 * patch embedding (conv3d over two identical frames), the learned position embedding bilinearly
 * interpolated to the patch grid, ViT blocks with 2-D RoPE, the 2x2 (merge_size^2) spatial merge
 * and the merger MLP to the text model's width, and the deepstack mergers at the layers
 * clip.vision.is_deepstack_layers marks. Weights F16 or F32 (packed at load into column panels,
 * F16 kept F16); float32 arithmetic, the SIMD kernels bitwise equal to their scalar twins, results
 * bitwise independent of the thread count and of the build's SIMD path. A handle is read-only after load except for its
 * error message: the caller keeps other threads off it during es_vision_encode.
 */
typedef struct es_vision es_vision;

typedef struct {
    int32_t patch_size;         /* pixels per patch side (16) */
    int32_t merge_size;         /* patches per merged token side (2); sides must be multiples of
                                   patch_size * merge_size */
    int32_t n_embd;             /* width of the output embeddings (the text model's hidden size) */
    int32_t n_embd_vision;      /* the ViT's width */
    int32_t n_layer, n_head;    /* the ViT's blocks and heads */
    int32_t n_deepstack;        /* deepstack mergers (outputs per image token) */
    float image_mean[3];        /* RGB normalisation: (value / 255 - mean) / std */
    float image_std[3];
    int64_t min_pixels;         /* the file's pixel budget, 0 when it has none */
    int64_t max_pixels;
} es_vision_info;

/* Load a projector GGUF. On failure *out is NULL and a message goes to err (like es_model_load):
 * ES_ERR_IO / ES_ERR_FORMAT (bad file or missing key), ES_ERR_UNSUPPORTED (not a "clip" file, a
 * projector type other than qwen3vl_merger, a weight type other than F32 / F16 / BF16 for vectors
 * and F32 / F16 for matrices), ES_ERR_MISSING_TENSOR (absent or mis-shaped tensor),
 * ES_ERR_BAD_WEIGHTS (a NaN or infinite weight), ES_ERR_NOMEM. */
es_status es_vision_load(const char *path, es_vision **out, char *err, size_t err_len);

/* Free a vision handle. NULL is a no-op. */
void es_vision_free(es_vision *vision);

/* Copy the encoder's sizes into *info. ES_ERR_INVALID_ARG when either is NULL. */
es_status es_vision_get_info(const es_vision *vision, es_vision_info *info);

/* Message of the last failed es_vision_encode ("" if none). */
const char *es_vision_last_error(const es_vision *vision);

/* The vision layer whose output deepstack merger k reads; -1 when k is out of range. */
int32_t es_vision_deepstack_layer(const es_vision *vision, int32_t k);

/*
 * Encode one image.
 *   pixels         float32 [3][height][width], RGB, already normalised with image_mean / std
 *   height, width  positive multiples of patch_size * merge_size (at most 65536 patches)
 *   n_threads      1 .. ES_MAX_THREADS (the results do not depend on it)
 *   embd_out       float32 [n_tokens][n_embd], n_tokens = (height / (patch_size * merge_size)) *
 *                  (width / (patch_size * merge_size)), tokens row-major over the merged grid
 *   deepstack_out  float32 [n_deepstack][n_tokens][n_embd], or NULL (not computed)
 * Errors (message on the handle): ES_ERR_INVALID_ARG for NULL pixels / embd_out, bad sizes or
 * thread count; ES_ERR_NOMEM; ES_ERR_INTERNAL when threads cannot be started.
 */
es_status es_vision_encode(es_vision *vision, const float *pixels, int32_t height, int32_t width,
                           int32_t n_threads, float *embd_out, float *deepstack_out);

/* ES_CDEF_END */

#ifdef __cplusplus
}
#endif

#endif /* ECHOSPEC_ENGINE_H */
