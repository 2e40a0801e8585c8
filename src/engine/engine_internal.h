/* engine_internal.h: what the engine's files share -- the context struct, the residual stream
 * and the layer blocks.
 *
 * Not a public header: only the engine's own .c files include it. Each block runs one part of a
 * layer over all rows of a batch: it reads its normed input from c->xn and writes its output to
 * c->y. The layer loop in ctx.c owns the residual stream: it takes each block's input from the
 * stream, norms it, runs the block the layer's plan names, and hands the output back to the
 * stream (moe_stream_ops: the plain residual adds it). */
#ifndef MOE_ENGINE_INTERNAL_H
#define MOE_ENGINE_INTERNAL_H

#include "engine.h"

/* Linear-attention layers of a hybrid model: each sequence's recurrent state, and the scratch
 * of the linear block (linear.c). Rows of a batch are processed grouped by sequence. */
typedef struct moe_linear_seg {
    int32_t seq, begin, n; /* rows order[begin .. begin + n) belong to seq, in position order */
} moe_linear_seg;

typedef struct moe_linear_ctx {
    uint32_t n_layer;      /* linear layers (0: the model is not a hybrid) */
    uint64_t conv_floats;  /* one layer's conv state: [2K + V channels][d_conv - 1] */
    uint64_t layer_floats; /* conv_floats + the delta-rule state [n_v_heads][hd][hd] */
    float *state;          /* [n_seq][n_layer][layer_floats] */
    int32_t *order;        /* [max_rows] batch rows grouped by sequence */
    int32_t *seq_count;    /* [n_seq + 1] counting-sort table */
    moe_linear_seg *segs;  /* [max_rows] */
    /* scratch, [max_rows][width] floats each, rows in `order` */
    float *x;             /* normed input [n_embd] */
    float *qkv;           /* q | k | v after the conv [2K + V] */
    float *z;             /* output gate [V] */
    float *g;             /* log decay [n_v_heads] (GDN) or [V] (KDA) */
    float *beta;          /* [n_v_heads] */
    float *tmp;           /* low-rank and beta/alpha projections [max(2 n_v_heads, hd)] */
    float *out;           /* delta-rule output, then gated-normed [V] */
    float *y;             /* output projection [n_embd] */
    float *delta_scratch; /* [n_threads][moe_delta_scratch_floats] */
} moe_linear_ctx;

/* What a replicated context's call is, as broadcast: its kind and arguments (ctx.c). */
typedef enum moe_dist_op_kind {
    MOE_OP_END = 1, /* the leader's context is freed: the followers stop */
    MOE_OP_DECODE,  /* a: rows (the rows follow, broadcast) */
    MOE_OP_VERIFY,
    MOE_OP_DECODE_MTP, /* a: rows (the rows and their hidden states follow) */
    MOE_OP_MTP_REWIND, /* seq, a: n */
    MOE_OP_ACCEPT,     /* seq, a: n_keep */
    MOE_OP_TRUNCATE,   /* seq, a: n */
    MOE_OP_SNAPSHOT,   /* seq */
    MOE_OP_RESTORE,    /* seq, a: snapshot */
    MOE_OP_DROP,       /* a: snapshot */
    MOE_OP_REUSE,      /* seq, a: tokens (they follow) */
} moe_dist_op_kind;
typedef struct moe_dist_op {
    int32_t kind, seq;
    uint32_t a;
} moe_dist_op;
/* This call is op: rank 0 broadcasts it, a follower takes it (the one its loop received, or
 * for a call made inside another the one rank 0 broadcasts) and ends the job when its own call
 * is a different one. Nothing for a context that is not replicated. */
void moe_ctx_dist_op(moe_ctx *c, moe_dist_op_kind kind, int32_t seq, uint32_t a);
/* A replicated call's payload: rank 0's `mine`, broadcast into a follower's `theirs` (returned
 * there); `mine` untouched where the context is not replicated. */
const void *moe_ctx_dist_payload(moe_ctx *c, const void *mine, void *theirs, size_t bytes);

/* A layer's routed experts as this rank holds them under MOE_SPLIT_ROWS (rows.c): the slice
 * [ff.begin, ff.end) of every expert's intermediate -- those rows of gate and up (of both halves
 * of a fused gate_up), those input columns of down, those values of the gate / up biases --
 * read from the file into the context's memory, so a rank holds only its slices. A pointer is
 * NULL where the model has no such tensor; the tensors have no rows when the slice is empty.
 * A dense FFN or shared expert under --split-dense: rows [ff.begin, ff.end) of gate and up, and
 * rows [out.begin, out.end) of down (whole rows: every dot is computed whole by one rank). */
typedef struct moe_rows_slice {
    moe_split_range ff;  /* the intermediate values (rows of gate and up) this rank computes */
    moe_split_range out; /* --split-dense: the output values (rows of down) it computes */
    const moe_tensor *gate, *up, *gate_up, *down, *gate_b, *up_b; /* into `t` */
    moe_tensor t[6];
    uint64_t bytes; /* of its slices, as read */
} moe_rows_slice;

/* Hyper-connection scratch (hyper.c), [max_rows][width] floats each. */
typedef struct moe_hc_ctx {
    float *wide; /* [n_hc n_embd] the normed streams, then the mixed ones (then c->x's) */
    float *mix;  /* [(2 + n_hc) n_hc] mixing logits */
    float *in;   /* [n_embd] a block's input; at the end the streams' mean */
    float *post; /* [n_hc] */
    float *comb; /* [n_hc n_hc] */
} moe_hc_ctx;

/* The lightning indexer of sparse MLA layers (indexer.c): each scoring layer's per-position
 * rows (moe_index_row_values: [key] or [key | pooling logits | pooled key]), and scratch. */
typedef struct moe_index_ctx {
    uint32_t n_layer;    /* indexed layers (0: none) */
    uint32_t *slot;      /* [layers run] index among the indexed layers */
    float *cache;        /* [n_seq][n_layer][n_ctx][moe_index_row_values] */
    float *k;            /* [max_rows][idx_head_dim] projections on their way to the cache */
    float *q;            /* [max_rows][idx_n_head idx_head_dim] indexer queries */
    float *w;            /* [max_rows][idx_n_head] per-head score weights */
    uint32_t n_pool_max; /* pools a context holds, + 1 */
    float *scores;       /* [n_threads][n_pool_max] a thread's pool scores (a row's: decode) */
    int32_t *sel;        /* [n_threads][top_k + kpool - 1] chosen pools */
    int32_t *chosen;     /* [max_rows][top_k + kpool - 1] the cells each row attends to, */
    int32_t *n_chosen;   /* [max_rows] how many (-1: all), kept for the layers that share them */
    uint8_t *gather;     /* [n_threads][top_k + kpool - 1] latent rows a query attends to */
    double *seconds;     /* [n_threads][2] time scoring pools, time attending (benchmarks) */
} moe_index_ctx;

/* The expert cache (expert_cache.c). */
typedef struct moe_expert_cache moe_expert_cache;
moe_expert_cache *moe_expert_cache_new(const moe_model *m, uint32_t n_layer_run, uint64_t bytes,
                                       moe_error *err);
void moe_expert_cache_free(moe_expert_cache *c);
/* Layer il's experts through the cache, for moe_expert_set.source. */
const moe_expert_source *moe_expert_cache_source(moe_expert_cache *c, uint32_t il);
/* The first read error since the last call, into err (true), or false. */
bool moe_expert_cache_take_error(moe_expert_cache *c, moe_error *err);
moe_expert_cache_stats moe_expert_cache_stats_of(moe_expert_cache *c);
/* Pin the experts a --pin-experts file lists ("LAYER EXPERT" or "LAYER:EXPERT" lines), then warm
 * the free slots with the experts a --expert-stats file says were used most (a missing file is a
 * cold start); either path may be NULL. */
bool moe_expert_cache_prepare(moe_expert_cache *c, const char *stats_path, const char *pin_path,
                              moe_error *err);
/* Write the use counts to the --expert-stats file (no file: nothing to do). */
bool moe_expert_cache_save_stats(const moe_expert_cache *c, moe_error *err);

/* A recurrent-state snapshot: sequence seq's state after its first pos tokens. */
typedef struct moe_snapshot {
    int32_t seq; /* -1: the slot is free */
    uint32_t pos;
    uint64_t used; /* last use, for least-recently-used replacement */
} moe_snapshot;

struct moe_ctx {
    const moe_model *m;
    moe_ctx_params p;
    uint32_t *seq_len;    /* [n_seq] tokens held per sequence */
    uint32_t *mtp_len;    /* [n_seq] entries held in the MTP layers' cache per sequence */
    int32_t *tokens;      /* [n_seq][n_ctx] the token ids each sequence holds */
    uint32_t *layer_slot; /* [n_layer] index among the attention layers (KV) or the linear ones */
    uint32_t n_layer_kv;  /* attention layers (softmax or latent) */
    /* KV cache: [n_seq][n_layer_kv][n_head_kv][n_ctx][head_dim], F32, F16 or Q8_0 by p.kv_type
     * (moe_kv_span_of; each layer's room n_ctx x the widest layer's row). With MLA, k_cache holds
     * the latent cache [n_lora_kv + rope_dims] as one head and v_cache is unused (V is the latent
     * part of each K row; v_row_bytes = 0). */
    uint8_t *k_cache, *v_cache;
    size_t k_cache_size, v_cache_size; /* what moe_huge_alloc gave (read end to end: huge pages) */
    uint64_t k_row_bytes, v_row_bytes; /* one position of one layer, all its heads */
    /* scratch, [max_rows][width] floats each */
    float *x;           /* [max_rows][max(1, n_hc)][n_embd] the residual stream(s) */
    float *xn;          /* [max_rows][max(n_embd, n_head * head_dim_v)] a block's normed input */
    const float *x_in;  /* [n_rows][n_embd] the running block's input before its norm (the
                         * stream's), for blocks that norm it more than one way (Gemma 4's FFN) */
    float *xn2;         /* [max_rows][n_embd] a second normed input (routed experts with their own
                         * input norm), NULL when no layer has one */
    float *y;           /* [max_rows][n_embd] a block's output */
    moe_row *dist_rows; /* [max_rows] rank 0's rows of the step, with a split (else NULL) */
    float *hidden;      /* [max_rows][n_embd] normed final hidden states of the last call's rows
                         * (what the MTP head takes) */
    uint32_t n_hidden;  /* rows in hidden */
    float *mtp_in;      /* [max_rows][2 n_embd] the MTP head's normed [embedding ; hidden] */
    float *mtp_h;       /* [n_embd] the hidden state a draft chain feeds back */
    float *q, *k, *v, *att, *ff_gate, *ff_up;
    float *scores;        /* [n_threads][n_ctx] attention scores (MOE_EXACT=1, indexed MLA) */
    uint32_t *attn_block; /* [max_rows + 1] first row of each block of the tiled attention */
    float *attn_scratch;  /* [n_threads][attn_scratch_n] the tiled attention's (its K / V tile) */
    size_t attn_scratch_n;
    /* multi-head latent attention scratch (NULL without MLA) */
    float *mla_qa;           /* [max_rows][n_lora_q] q down-projection */
    float *mla_q;            /* [max_rows][n_head * head_dim_k_mla] q before absorption */
    float *mla_o;            /* [max_rows][n_head * head_dim_v_mla] latent decompressed by wv_b */
    float *mla_in, *mla_out; /* [max_rows][mla_head_max] one head of every row, gathered */
    /* mixture of experts */
    float *router;        /* [max_rows][n_expert] router logits */
    int32_t *expert_ids;  /* [max_rows][n_expert_used] */
    float *expert_w;      /* [max_rows][n_expert_used] */
    float *route_scratch; /* [2 * n_expert] */
    moe_expert_scratch experts;
    moe_expert_stats stats; /* of the last moe_ctx_decode */
    moe_pool *pool;
    void *mm_scratch;                    /* activation rows converted for the dot kernels */
    float *att_gate;                     /* [max_rows][n_head * head_dim_v] attention output gate */
    float *shexp_gate;                   /* [max_rows] shared-expert gate logits */
    const struct moe_stream_ops *stream; /* how the trunk's block outputs join the residual
                                          * stream (the NextN block's: always plain) */
    moe_hc_ctx hc;
    moe_expert_cache *expert_cache; /* NULL: the routed experts are resident */
    moe_rows_slice *rows_slice;     /* [layers run] split by rows over ranks (else NULL) */
    moe_rows_slice *dense_slice;    /* [layers run] --split-dense: each layer's dense FFN or
                                     * shared expert: rows of gate, up and down (else NULL) */
    /* replicated (moe_ctx_lead / moe_ctx_follow): every state-changing call is rank 0's,
     * broadcast as an op before it runs; a follower's loop leaves the op it took in `pending` */
    bool replicate, has_pending;
    moe_dist_op pending;
    float *follow_h;        /* [max_rows][n_embd] a follower's copy of rank 0's MTP inputs */
    int32_t *follow_tokens; /* [n_ctx] a follower's copy of rank 0's prefix tokens */
    uint8_t *rows_mem;      /* the slices' bytes */
    moe_index_ctx idx;
    moe_linear_ctx lin;
    /* verify steps: for each sequence its length before the last one and its rows in it (0:
     * nothing to accept), and the recurrent state after each of those rows */
    uint32_t *verify_base, *verify_rows; /* [n_seq] */
    bool verifying;                      /* inside moe_ctx_verify */
    float *ckpt;         /* [n_seq][p.n_verify - 1][lin.n_layer][lin.layer_floats], hybrids only */
    moe_snapshot *snaps; /* [p.n_snapshots] */
    float *snap_state;   /* [p.n_snapshots][lin.n_layer][lin.layer_floats] */
    uint64_t snap_clock;
};

/* Read this rank's slices of every routed-expert layer (split by rows over several ranks) and,
 * with split_dense, of every dense FFN and shared expert. */
moe_status moe_rows_load(moe_ctx *c, uint32_t n_layer_run, moe_error *err);

/* ==== KV cache ==== */

/* One sequence's K (or V) cache of one layer: KV head h's position p at
 * at + h * head + p * stride. A head's positions lie side by side, so decode reads each head's
 * keys in order: the cache as [seq][layer][position][head] put one head's keys a whole row apart
 * (1 KiB on Qwen3-30B-A3B), in a quarter of the L1's sets, and the lines prefetched a tile ahead
 * were evicted before use (bench/attention --rows 1 --tiled-only --depth 16384 --layers 6 --runs 5,
 * one thread, Zen 5, under load ~4: f16 6.3-6.7 -> 5.1-5.7, q8_0 6.7 -> 5.0 ns per row x head x
 * key; 4.9 in cache). */
typedef struct moe_kv_span {
    uint8_t *at;
    uint64_t stride; /* one head's values of a position in the KV type */
    uint64_t head;   /* n_ctx * stride */
    uint32_t n_head; /* the layer's KV heads (a latent (MLA) row: 1; its V: 0) */
} moe_kv_span;
moe_kv_span moe_kv_span_of(const moe_ctx *c, bool v, int32_t seq, uint32_t layer);
/* Store n floats into a cache row in the context's KV element type. */
void moe_kv_store(const moe_ctx *c, uint8_t *dst, const float *src, uint64_t n);

/* ==== Attention over the cache ==== */

/* The fast path's tiled attention: how many parts a group of `group` query heads splits into
 * when `items` (blocks x kv heads) are to go round the pool's threads (a power of two). */
int moe_attn_split(const moe_ctx *c, int64_t items, int group);
/* Every row's query (c->q, rows of n_head * head_dim_k) attends causally over its sequence's
 * cache of `layer` (the last `window` positions when window > 0) into c->att (rows of
 * n_head * head_dim_v). latent_v: V is the first head_dim_v values of each K row (MLA). */
void moe_attend_rows(moe_ctx *c, const moe_attn_shape *shape, uint32_t layer, const moe_row *rows,
                     uint32_t n_rows, uint32_t window, bool latent_v);

/* ==== The lightning indexer (indexer.c) ==== */

/* Indexed layers among the first n_layer_run, and their f32 values per token of context. */
void moe_indexer_plan(const moe_model *m, uint32_t n_layer_run, uint32_t *n_layer,
                      uint64_t *floats_per_token);
/* Allocate c->idx (after the KV rows and the pool are set up). */
void moe_indexer_alloc(moe_ctx *c, uint32_t n_layer_run);
void moe_indexer_free(moe_ctx *c);
/* The indexer row of one sequence, indexed layer and position. */
float *moe_indexer_row(const moe_ctx *c, int32_t seq, uint32_t layer, uint32_t pos);
/* Write the rows' keys and pooling logits (from c->xn) and the pools they complete. */
void moe_indexer_update(moe_ctx *c, const moe_layer_weights *l, uint32_t il, const moe_row *rows,
                        uint32_t n_rows);
/* moe_attend_rows over a latent cache, each query restricted to what the indexer selects (its
 * queries from the normed q latent c->mla_qa and c->xn). */
void moe_attend_rows_indexed(moe_ctx *c, const moe_attn_shape *shape, const moe_layer_weights *l,
                             uint32_t il, const moe_row *rows, uint32_t n_rows);

/* ==== The residual stream ==== */

typedef enum moe_site { MOE_SITE_MIXER, MOE_SITE_FFN } moe_site;

/* How the layer loop keeps the residual stream: where a block's input comes from and where its
 * output goes. The plain residual keeps one stream per row (x += block(norm(x))); a model with
 * hyper-connections keeps several per row and mixes them around every block. */
typedef struct moe_stream_ops {
    /* Start the streams of n_rows rows from their embeddings ([n_rows][n_embd]). */
    void (*begin)(moe_ctx *c, const float *embd, uint32_t n_rows);
    /* The input of layer l's block at `site`, [n_rows][n_embd] (before its norm). */
    const float *(*pre)(moe_ctx *c, const moe_layer_weights *l, moe_site site, uint32_t n_rows);
    /* Take the block's output (c->y) into the streams; after the FFN, scale them by the
     * layer's out_scale where it has one (the plain stream does; hyper-connections do not
     * meet a model with one yet). */
    void (*post)(moe_ctx *c, const moe_layer_weights *l, moe_site site, uint32_t n_rows);
    /* The hidden state of row r that the output head reads, [n_embd]. */
    const float *(*final)(moe_ctx *c, uint32_t r);
} moe_stream_ops;

extern const moe_stream_ops moe_stream_plain;
/* cfg.n_hc streams per row, mixed around every block (hyper.c). */
extern const moe_stream_ops moe_stream_hc;
void moe_hc_alloc(moe_ctx *c);
void moe_hc_free(moe_ctx *c);

/* ==== Layer blocks: c->xn (normed input, [n_rows][n_embd]) in, c->y ([n_rows][n_embd]) out ==== */

/* rows[r] = RMSNorm(rows[r]) * norm in place for n_rows rows of `width` (norm NULL: nothing);
 * a block's output norm (Gemma's post-attention and post-FFN norms). */
void moe_rows_post_norm(moe_ctx *c, float *rows, const moe_tensor *norm, uint32_t n_rows,
                        int64_t width);

typedef void (*moe_mixer_block)(moe_ctx *c, const moe_layer_weights *l, uint32_t layer,
                                const moe_row *rows, uint32_t n_rows);
/* grouped-query attention (attention.c) */
/* Scratch bytes the attention block of layer l converts n_rows rows into (q, k and v at once). */
uint64_t moe_attention_scratch_bytes(const moe_layer_weights *l, uint32_t n_rows);
void moe_block_attention(moe_ctx *c, const moe_layer_weights *l, uint32_t layer,
                         const moe_row *rows, uint32_t n_rows);
/* multi-head latent attention (mla.c): latent cache, absorbed attn_k_b / attn_v_b */
void moe_block_attention_mla(moe_ctx *c, const moe_layer_weights *l, uint32_t layer,
                             const moe_row *rows, uint32_t n_rows);
/* Gated DeltaNet and Kimi Delta Attention (linear.c) */
void moe_block_linear(moe_ctx *c, const moe_layer_weights *l, uint32_t layer, const moe_row *rows,
                      uint32_t n_rows);
/* dense FFN and routed experts (ffn.c) */
void moe_block_ffn_dense(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows);
/* A layer's routed experts as the dispatch runs them, all resident (no source, one shard). */
moe_expert_set moe_expert_set_of(const moe_model_config *cfg, const moe_layer_weights *l);
void moe_block_ffn_experts(moe_ctx *c, const moe_layer_weights *l, uint32_t n_rows);

/* ==== Linear attention state (linear.c) ==== */

/* The recurrent state's sizes into lin (zeros for a model without linear layers). */
void moe_linear_plan(const moe_model *m, moe_linear_ctx *lin);
/* Allocate c->lin: the state of every sequence (zeros) and the block's scratch. */
void moe_linear_alloc(moe_ctx *c);
void moe_linear_free(moe_ctx *c);
/* A sequence's recurrent state, all linear layers: [lin.n_layer][lin.layer_floats]. */
float *moe_linear_seq_state(const moe_ctx *c, int32_t seq);
/* The same, as it stood after row `row` (not its last) of seq's rows in the last verify step. */
float *moe_linear_checkpoint(const moe_ctx *c, int32_t seq, uint32_t row);
/* Checkpoints a sequence holds: one for each row of a verify step but its last. */
uint32_t moe_verify_checkpoints(const moe_ctx_params *p);

#endif
