/* engine: model state and the batched forward pass; works in token ids only (never text).
 *
 * A moe_ctx owns a model's KV cache for up to n_seq sequences and the scratch for batches of
 * up to max_rows rows, all allocated when it is created: the token loop does not allocate.
 * moe_ctx_decode() runs one forward pass over a batch of rows, each (sequence, position,
 * token); prefill of one prompt and decode of many streams are the same call. The trap: a
 * row's position must be the next position of its sequence (rows of one sequence in order);
 * to go back, truncate the sequence first. */
#ifndef MOE_ENGINE_H
#define MOE_ENGINE_H

#include <stdbool.h>
#include <stdint.h>

#include "../model/model.h"
#include "../ops/ops.h"

typedef struct moe_row {
    int32_t seq;   /* sequence index, < n_seq */
    int32_t pos;   /* position in that sequence */
    int32_t token; /* token id, < n_vocab */
    bool logits;   /* compute this row's logits */
} moe_row;

/* How the ranks of an MPI job share the routed experts (engine/dist.c). */
typedef enum moe_split {
    MOE_SPLIT_NONE,    /* every rank holds and runs everything (one rank: the only choice) */
    MOE_SPLIT_EXPERTS, /* rank r runs the routed experts e with e % n_ranks == r; the MoE block's
                        * partial outputs are summed across ranks in rank order */
    MOE_SPLIT_ROWS,    /* rank r runs every routed expert on its slice of the intermediate
                        * (moe_split_rows_range): those rows of gate / up, those input columns of
                        * down; the partial down projections are summed across ranks in rank order */
    MOE_SPLIT_COUNT
} moe_split;

typedef struct moe_ctx_params {
    uint32_t n_ctx;       /* positions per sequence (0: the model's training context, capped) */
    uint32_t n_seq;       /* sequences held at once */
    uint32_t max_rows;    /* rows per forward call */
    moe_type kv_type;     /* KV cache elements: MOE_TYPE_F32 (0, the default), F16 or Q8_0 */
    int n_threads;        /* threads for the forward pass, including the caller (0: 1) */
    uint32_t n_snapshots; /* recurrent-state snapshots held at once (0: 2 per sequence) */
    uint32_t n_verify;    /* rows per sequence a verify step can take back (0: no verify steps) */
    uint64_t expert_cache_bytes; /* routed experts read from the file into a cache of this size
                                  * (0: the model's experts are all resident) */
    const char *expert_stats;    /* with a cache: use counts kept in this file across runs (the
                                  * hottest experts read at start), or NULL */
    const char *pin_experts;     /* with a cache: experts always resident, listed one per line as
                                  * "LAYER EXPERT", or NULL */
    moe_split split;  /* across the ranks of an MPI job (MOE_SPLIT_NONE: no MPI calls at all);
                       * every rank must create its context with the same parameters */
    bool split_dense; /* with a split: each dense FFN and shared expert split by its intermediate
                       * too (as MOE_SPLIT_ROWS splits an expert), its partial sums summed */
} moe_ctx_params;

/* The expert cache's counters (cumulative; all zero without one). */
typedef struct moe_expert_cache_stats {
    uint64_t hits, misses, evictions; /* experts acquired: resident, read, thrown out for them */
    uint64_t read_ahead; /* reads made ahead by the reader thread (no step waited for them) */
    uint64_t bytes_read; /* from the model file */
    double read_seconds; /* steps waiting for those reads (stall) */
    double busy_seconds; /* time at least one read was in flight (bytes_read / it: bandwidth) */
    uint32_t slots;      /* experts it holds */
    uint64_t slot_bytes; /* one expert of the widest layer: gate + up + down */
    bool direct;         /* reads bypass the page cache (O_DIRECT) */
} moe_expert_cache_stats;

/* What a context's state costs, decided before anything is allocated (moe budget, load). */
typedef struct moe_ctx_memory {
    uint64_t kv_bytes_per_token;      /* K + V of one position over the full-attention layers */
    uint64_t kv_bytes;                /* n_seq x n_ctx positions */
    uint64_t recurrent_bytes_per_seq; /* conv + delta-rule state over the linear layers */
    uint64_t recurrent_bytes;         /* n_seq of them */
    uint64_t snapshot_bytes;          /* n_snapshots of them */
    uint64_t checkpoint_bytes;        /* n_seq x (n_verify - 1) of them, for verify steps */
    uint64_t token_bytes;             /* the token ids each sequence holds */
    uint64_t total;                   /* all of the above (scratch not included) */
} moe_ctx_memory;

typedef struct moe_ctx moe_ctx;

moe_ctx *moe_ctx_new(const moe_model *m, const moe_ctx_params *p, moe_error *err);
moe_status moe_ctx_memory_plan(const moe_model *m, const moe_ctx_params *p, moe_ctx_memory *out,
                               moe_error *err);
void moe_ctx_free(moe_ctx *c);
const moe_model *moe_ctx_model(const moe_ctx *c);
/* The context's thread pool (work that is not a forward pass may borrow it between calls). */
moe_pool *moe_ctx_pool(moe_ctx *c);
int moe_ctx_n_threads(const moe_ctx *c);
uint32_t moe_ctx_n_ctx(const moe_ctx *c);

/* Serve and chat under mpirun: rank 0's context leads -- each call that changes its state is
 * broadcast to the other ranks before it runs, and freeing it stops them -- and the others'
 * follow: moe_ctx_follow runs rank 0's calls on them, computing no logits, until rank 0 frees
 * its context (then MOE_OK; the caller frees its own). Both need a context with a split, made
 * with the same parameters on every rank; a follower whose call differs from rank 0's (the
 * ranks diverged) ends the job. No-ops with one rank. */
void moe_ctx_lead(moe_ctx *c);
moe_status moe_ctx_follow(moe_ctx *c, moe_error *err);

/* Run the rows; logits gets one [n_vocab] row per row with .logits set, in batch order (NULL:
 * none computed, the hidden states still are). */
moe_status moe_ctx_decode(moe_ctx *c, const moe_row *rows, uint32_t n_rows, float *logits,
                          moe_error *err);
/* The normed final hidden states (after output_norm; after the MTP head's norm for a
 * moe_ctx_decode_mtp call) of every row of the last call, in batch order: *n_rows of [n_embd].
 * Valid until the next call. */
const float *moe_ctx_hidden(const moe_ctx *c, uint32_t *n_rows);
/* Entries seq holds in the MTP head's cache, and taking back those past the first n. */
uint32_t moe_ctx_mtp_len(const moe_ctx *c, int32_t seq);
void moe_ctx_mtp_rewind(moe_ctx *c, int32_t seq, uint32_t n);
/* The MTP / NextN head (models with one; else MOE_ERR_UNSUPPORTED): row r pairs h[r] (a hidden
 * state from moe_ctx_hidden, [n_rows][n_embd]) with rows[r].token, the token that followed it,
 * at the sequence's next MTP position (its own cache, positions from 0); logits are its draft
 * for the token after that. */
moe_status moe_ctx_decode_mtp(moe_ctx *c, const moe_row *rows, uint32_t n_rows, const float *h,
                              float *logits, moe_error *err);
/* Expert dispatch counters of the last moe_ctx_decode, summed over its MoE layers. */
moe_expert_stats moe_ctx_expert_stats(const moe_ctx *c);
/* Bytes of the trunk's routed-expert weights this rank holds: split by rows, the slices it read
 * (counted as they were laid out) and the down biases and scales it holds whole; otherwise
 * moe_split_expert_bytes of its split. */
uint64_t moe_ctx_routed_bytes(const moe_ctx *c);
moe_expert_cache_stats moe_ctx_expert_cache_stats(const moe_ctx *c);
/* Bytes of one expert cache slot for m (0: no routed experts): sizes --expert-cache. */
uint64_t moe_expert_cache_slot_bytes(const moe_model *m, uint32_t n_layer_run);
/* Seconds the indexed (sparse MLA) layers spent since the context was made, summed over
 * threads: scoring the indexer's pools and choosing the best, and attending (to the selected
 * keys, or to every key while that is no more). For benchmarks, which read differences. */
typedef struct moe_indexer_time {
    double score_seconds, attend_seconds;
} moe_indexer_time;
moe_indexer_time moe_ctx_indexer_time(const moe_ctx *c);
/* Tokens held for a sequence (its next position). */
uint32_t moe_ctx_seq_len(const moe_ctx *c, int32_t seq);

/* ==== Verify steps (speculative decoding) ====
 *
 * A verify step runs rows that may be taken back: a sequence's next token and the drafts after
 * it. It is moe_ctx_decode (same logits, bit for bit) that also keeps, for each sequence in it, a
 * checkpoint of the recurrent state after each of its rows but the last (at most n_verify - 1;
 * after the last is the live state), so that moe_ctx_seq_accept can then keep any first part of
 * them -- KV rows past it dropped, the linear state taken from the checkpoint, no recompute. Any
 * other call on the sequence ends the choice. */
moe_status moe_ctx_verify(moe_ctx *c, const moe_row *rows, uint32_t n_rows, float *logits,
                          moe_error *err);
/* Keep the first n_keep (1..its rows) of seq's rows in the last verify step. */
moe_status moe_ctx_seq_accept(moe_ctx *c, int32_t seq, uint32_t n_keep, moe_error *err);

/* Where speculative drafts come from (moe run / chat / serve --spec). */
typedef enum moe_spec_kind {
    MOE_SPEC_NONE,
    MOE_SPEC_NGRAM, /* prompt lookup: the tokens after an earlier occurrence of the suffix */
    MOE_SPEC_MTP,   /* the model's own multi-token-prediction head */
} moe_spec_kind;
#define MOE_SPEC_MAX_DRAFT 16 /* drafts per step (--draft N) at most */

/* N-gram (prompt-lookup) drafts (spec.c): the tokens that followed the most recent earlier
 * occurrence of hist's last MOE_NGRAM_MAX (else fewer, down to 1) tokens, at most max_draft of
 * them into out; 0 when the suffix never occurred before. */
#define MOE_NGRAM_MAX 3
uint32_t moe_draft_ngram(const int32_t *hist, uint32_t n_hist, uint32_t max_draft, int32_t *out);
/* MTP drafts (spec.c): first the entries seq's MTP cache lacks -- for i < n_in, h[i] (a trunk
 * hidden state, [n_embd]) at MTP position moe_ctx_mtp_len + i with tokens[i], the token that
 * followed it (the last one: the token about to be fed) -- then n_draft greedy drafts: the first
 * from the last entry, each next one from the head run on the draft before and the head's own
 * hidden state. The drafts' entries are taken back (the cache keeps the n_in entries fed).
 * logits: [n_vocab] scratch. Returns the drafts written (n_draft, or 0 on an error). */
uint32_t moe_draft_mtp(moe_ctx *c, int32_t seq, const float *h, const int32_t *tokens,
                       uint32_t n_in, uint32_t n_draft, int32_t *drafts, float *logits,
                       moe_error *err);

/* ==== Sequence state: truncation, snapshots, prefix reuse (state.c) ====
 *
 * Attention layers keep K/V rows per position, so a sequence can be cut back to any length.
 * Linear-attention layers (hybrid models) keep one recurrent state per sequence that already
 * includes every token fed: it cannot be cut back, only replaced by a copy taken earlier. A
 * snapshot copies a sequence's recurrent state as it stands now (its length is the snapshot's
 * position) and stays valid while that sequence keeps those first tokens: truncating the
 * sequence below it, or restoring something else into it, drops it. Restoring a snapshot into a
 * sequence makes it hold exactly the snapshot's tokens: K/V rows are truncated (the same
 * sequence) or copied (another one) and the recurrent state is copied. The context remembers
 * the token ids of every sequence, so moe_ctx_seq_reuse can pick the longest reusable prefix
 * itself and a sequence never runs on state that includes tokens its caller did not give. */

/* Forget positions >= n of a sequence (0 clears it). On a hybrid model this needs a snapshot
 * of the sequence at exactly n (or n == 0, or n >= its length); otherwise it fails and the
 * sequence is unchanged. Snapshots of the sequence past n are dropped. */
moe_status moe_ctx_seq_truncate(moe_ctx *c, int32_t seq, uint32_t n, moe_error *err);
/* Snapshot seq's recurrent state at its current length into a free slot (else the least
 * recently used one); returns the slot id (>= 0), or -1 with err set. */
int32_t moe_ctx_seq_snapshot(moe_ctx *c, int32_t seq, moe_error *err);
/* Make seq hold exactly what the snapshot holds (see above). */
moe_status moe_ctx_seq_restore(moe_ctx *c, int32_t seq, int32_t snapshot, moe_error *err);
/* Free a snapshot slot (an unknown or free slot is ignored). */
void moe_ctx_snapshot_drop(moe_ctx *c, int32_t snapshot);
/* The sequence and position a snapshot was taken at; false when the slot is free. */
bool moe_ctx_snapshot_info(const moe_ctx *c, int32_t snapshot, int32_t *seq, uint32_t *pos);
/* Prefix reuse: make seq hold the longest prefix of tokens[0..n) this context can reproduce
 * exactly -- from seq itself, another sequence, or a snapshot -- and set *reused to its length
 * L; the caller then feeds tokens[L..n). Pass n = prompt length - 1 to be sure of the last
 * prompt token's logits. Whatever else seq held is forgotten. */
moe_status moe_ctx_seq_reuse(moe_ctx *c, int32_t seq, const int32_t *tokens, uint32_t n,
                             uint32_t *reused, moe_error *err);
/* How many tokens moe_ctx_seq_reuse could take from seq alone (its live tokens or one of its
 * snapshots) for tokens[0..n); 0 for an unknown seq. Changes nothing. */
uint32_t moe_ctx_seq_prefix(const moe_ctx *c, int32_t seq, const int32_t *tokens, uint32_t n);
/* The token ids seq holds (moe_ctx_seq_len of them). */
const int32_t *moe_ctx_seq_tokens(const moe_ctx *c, int32_t seq);

/* ==== Disk prefix cache (disk_cache.c) ====
 *
 * Sequences saved to files in a directory, so a prefix survives a restart or its sequence's
 * eviction from RAM. An entry holds one sequence's first n tokens: the token ids, the K/V (or
 * latent) rows of its attention layers with their indexer rows (sparse MLA) and, on a hybrid
 * model, the recurrent state after those n tokens. Entries are keyed by a hash of the token prefix
 * and of the context's identity (the model file's size, mtime and GGUF header, the KV type, n_ctx
 * and the kernel table): a context uses only its own. Everything is checksummed (the header with
 * the token ids, each chunk of positions, the recurrent state); a damaged or truncated entry is
 * removed, never resumed. A load checks the token ids stored in the entry itself against the
 * caller's, not only the hash. Loads and saves run on the cache's own thread: a sequence with one
 * queued must not change until moe_disk_cache_busy() says false (moe_disk_cache_wait waits for
 * that). Without linear layers any prefix of an entry is usable; with them only the whole entry
 * (the recurrent state exists for its last position only). The directory is kept under a size
 * limit by removing the least recently used entries, whichever context wrote them. */

typedef struct moe_disk_cache moe_disk_cache;

typedef struct moe_disk_hit {
    char name[64]; /* the entry's file in the directory */
    uint32_t n;    /* tokens it can give */
} moe_disk_hit;

typedef struct moe_disk_cache_stats {
    uint64_t entries, bytes, max_bytes; /* in the directory now (every identity) */
    uint64_t hits, hit_tokens;          /* loads that succeeded, tokens they gave */
    uint64_t writes, write_bytes;       /* entries written */
    uint64_t evicted;                   /* removed for the size limit or superseded */
    uint64_t corrupt;                   /* damaged or truncated entries found (and removed) */
    uint64_t write_errors;
} moe_disk_cache_stats;

/* Open (creating it) the directory for context c, whose model and settings are the identity;
 * reads every entry's header, removes damaged ones and trims to max_bytes. */
moe_disk_cache *moe_disk_cache_open(moe_ctx *c, const char *dir, uint64_t max_bytes,
                                    moe_error *err);
/* Finish the queued loads and saves, then free. */
void moe_disk_cache_close(moe_disk_cache *d);
/* The longest prefix of tokens[0..n) an entry can give (0: none; *hit names it). */
uint32_t moe_disk_cache_find(moe_disk_cache *d, const int32_t *tokens, uint32_t n,
                             moe_disk_hit *hit);
/* Start extending seq, which holds a prefix of tokens[0..n) (moe_ctx_seq_reuse), to hit->n
 * tokens from the entry, on the cache's thread; seq must stay untouched until
 * moe_disk_cache_load_end says it is done (moe_disk_cache_on_load's fn is called then). */
moe_status moe_disk_cache_load_begin(moe_disk_cache *d, int32_t seq, const moe_disk_hit *hit,
                                     const int32_t *tokens, uint32_t n, moe_error *err);
/* false while seq's load runs. Then true: seq holds hit->n tokens (err untouched), or still what
 * it held with err saying why (a damaged entry is removed). On the engine thread. */
bool moe_disk_cache_load_end(moe_disk_cache *d, int32_t seq, moe_error *err);
/* fn(arg) on the cache's thread whenever a load is done (wakes the engine thread). */
void moe_disk_cache_on_load(moe_disk_cache *d, void (*fn)(void *arg), void *arg);
/* Queue a save of seq's first n tokens (n: its length, or on a hybrid the position of one of
 * its snapshots). false: nothing queued (an entry already holds them, no snapshot there, too
 * large for the limit). */
bool moe_disk_cache_save(moe_disk_cache *d, int32_t seq, uint32_t n);
/* A queued save or load still uses seq's rows. */
bool moe_disk_cache_busy(moe_disk_cache *d, int32_t seq);
void moe_disk_cache_wait(moe_disk_cache *d, int32_t seq);
void moe_disk_cache_get_stats(moe_disk_cache *d, moe_disk_cache_stats *out);

/* ==== Grammars: constrained decoding (grammar.c) ====
 *
 * A GBNF grammar (llama.cpp's language: `name ::= alternatives`, "literals", [classes],
 * [^negated], ., ( groups ), * + ? {m} {m,} {m,n}, # comments) decides which tokens may come
 * next. The engine sees ids only: the caller gives each token's bytes once (the vocabulary,
 * made into a byte trie), and a per-sequence state follows the tokens chosen. */

typedef struct moe_grammar moe_grammar;             /* parsed; immutable, shareable */
typedef struct moe_grammar_vocab moe_grammar_vocab; /* a vocabulary's byte trie; immutable */
typedef struct moe_grammar_state moe_grammar_state; /* one sequence's place in a grammar */

/* Parse; errors say "grammar:LINE:COL: what". root: the start rule (NULL: "root"). */
moe_grammar *moe_grammar_parse(const char *src, size_t len, const char *root, moe_error *err);
void moe_grammar_free(moe_grammar *g);

/* Token id -> the bytes it puts in the output (NULL-safe when *len is 0) and whether it ends
 * generation (such tokens are allowed exactly when the grammar is complete). */
typedef const char *(*moe_grammar_piece_fn)(void *ud, int32_t id, size_t *len, bool *eog);
/* strip_first_space: the output drops one leading space of the first non-empty piece (SPM's
 * dummy prefix, as the detokenizer does): the grammar then sees the piece without it. */
moe_grammar_vocab *moe_grammar_vocab_new(uint32_t n_vocab, moe_grammar_piece_fn piece, void *ud,
                                         bool strip_first_space);
void moe_grammar_vocab_free(moe_grammar_vocab *v);
/* The first end-of-generation token, or -1. */
int32_t moe_grammar_vocab_eog(const moe_grammar_vocab *v);

/* v may be NULL for a state fed bytes only (moe_grammar_state_accept_bytes). */
moe_grammar_state *moe_grammar_state_new(const moe_grammar *g, const moe_grammar_vocab *v);
void moe_grammar_state_free(moe_grammar_state *st);
void moe_grammar_state_reset(moe_grammar_state *st);
/* Set the logits of every token the grammar does not allow now to -inf; returns how many
 * tokens remain allowed. */
uint32_t moe_grammar_state_apply(moe_grammar_state *st, float *logits);
bool moe_grammar_state_allows(moe_grammar_state *st, int32_t token);
/* The same answer for one token, by walking its bytes only (no mask is built). */
bool moe_grammar_state_can_take(moe_grammar_state *st, int32_t token);
/* Follow a chosen token (false, state unusable, if the grammar cannot take it). */
bool moe_grammar_state_accept(moe_grammar_state *st, int32_t token);
bool moe_grammar_state_accept_bytes(moe_grammar_state *st, const char *s, size_t len);
/* The text so far is a whole sentence of the grammar. */
bool moe_grammar_state_complete(const moe_grammar_state *st);

/* ==== Sampling ==== */

typedef struct moe_sampler_params {
    float temperature;       /* <= 0: greedy */
    int32_t top_k;           /* <= 0: off */
    float top_p;             /* >= 1: off */
    float min_p;             /* <= 0: off */
    float repeat_penalty;    /* 1: off; divides positive / multiplies negative logits */
    float presence_penalty;  /* subtracted once from every token seen in the window */
    float frequency_penalty; /* subtracted per occurrence in the window */
    int32_t penalty_last_n;  /* window of recent tokens the penalties look at */
    uint64_t seed;
    const int32_t *bias_tokens; /* logit_bias: tokens ... */
    const float *bias_values;   /* ... and what is added to their logits (-inf bans) */
    uint32_t n_bias;
    uint32_t n_top_logprobs; /* alternatives reported per step (<= MOE_SAMPLER_MAX_TOP) */
    /* constrained decoding: tokens the grammar does not allow are never chosen (both or
     * neither; they must outlive the sampler). When the grammar allows nothing, the first
     * end-of-generation token is chosen. */
    const moe_grammar *grammar;
    const moe_grammar_vocab *grammar_vocab;
} moe_sampler_params;

#define MOE_SAMPLER_MAX_TOP 20 /* OpenAI's top_logprobs maximum */

typedef struct moe_sample {
    int32_t token;
    float logprob; /* of the chosen token, under the full softmax */
    uint32_t n_top;
    int32_t top_tokens[MOE_SAMPLER_MAX_TOP]; /* most likely first */
    float top_logprobs[MOE_SAMPLER_MAX_TOP];
} moe_sample;

typedef struct moe_sampler moe_sampler;

moe_sampler *moe_sampler_new(const moe_sampler_params *p, uint32_t n_vocab);
void moe_sampler_free(moe_sampler *s);
/* Pick the next token from one logits row (not modified); remembers it for the penalties. */
moe_sample moe_sampler_sample(moe_sampler *s, const float *logits);
/* The sampler's grammar state (NULL without a grammar). */
moe_grammar_state *moe_sampler_grammar(moe_sampler *s);
/* Tell the sampler about prompt tokens (they count for the penalties). */
void moe_sampler_accept(moe_sampler *s, int32_t token);
void moe_sampler_reset(moe_sampler *s);
/* The log-probability of a given token (a prompt token, not a draw) under the raw logits (no
 * bias, penalties or temperature), and the sampler's n_top_logprobs best alternatives; the
 * token is not remembered for the penalties. */
moe_sample moe_sampler_score(moe_sampler *s, const float *logits, int32_t token);
/* log-softmax of one logits row at token: logit - max - log(sum exp(logit_i - max)), summed in
 * double. What `moe eval` scores with; moe_sampler_score rounds the same value to float. */
double moe_logprob(const float *logits, uint32_t n_vocab, int32_t token);

/* ==== Ranks of an MPI job (dist.c) ====
 * Built with `make MPI=1` these are Open MPI; otherwise one rank: moe_dist_init fails with a
 * message saying how to build with MPI, and the rest do nothing. Collectives must be called by
 * every rank in the same order, from one thread at a time. */
bool moe_dist_built(void);                /* built with MOE_MPI */
moe_status moe_dist_init(moe_error *err); /* idempotent; also fine outside mpirun (one rank) */
void moe_dist_finalize(void);
void moe_dist_abort(int code); /* end every rank of a job of more than one (so none hangs) */
int moe_dist_rank(void);       /* 0 before init */
int moe_dist_size(void);       /* 1 before init */
/* buf[0..n) = the sum over ranks r = 0, 1, ... of rank r's buf, added in that order on rank 0 and
 * broadcast: every rank gets the same bits, whatever the timing. */
void moe_dist_sum(float *buf, size_t n);
void moe_dist_bcast(void *buf, size_t bytes); /* rank 0's bytes to every rank */
/* The same for a rank that may wait long (a follower between rank 0's calls): it sleeps between
 * polls (up to 1 ms) instead of spinning a core. */
void moe_dist_bcast_idle(void *buf, size_t bytes);
/* Every rank's `bytes` at mine, in rank order, into rank 0's all ([n_ranks][bytes]; NULL and
 * untouched elsewhere). */
void moe_dist_gather(const void *mine, size_t bytes, void *all);
/* Rows of width values split by columns: rank r holds columns moe_split_rows_range(width, 1, r,
 * K) of every row, packed ([n_rows][its columns] at mine); afterwards every rank's all
 * ([n_rows][width]; it may be mine) holds every rank's columns. Only moved, never added. */
void moe_dist_join(float *all, const float *mine, uint32_t n_rows, int64_t width);
/* A rank whose process is gone: every wait above looks (each 0.1 s) whether the ranks it depends
 * on still exist -- rank 0 every other, the others rank 0; only processes on this machine, by
 * pid -- and one that finds a rank gone ends the job with a message naming it. Except rank 0
 * after moe_dist_outlive_loss: its waits return, every later call returns at once with nothing
 * exchanged (the step's numbers are garbage), and moe_dist_lost reports the loss; its
 * moe_dist_finalize ends the job. moe_dist_lost: the rank found gone (look_now: looked for now,
 * else only as the waits found it), err naming it; -1 while none is. */
void moe_dist_outlive_loss(void);
int moe_dist_lost(bool look_now, moe_error *err);
typedef struct moe_dist_times {
    double wait_seconds;   /* in moe_dist_sum, waiting for the slowest rank to arrive */
    double reduce_seconds; /* in moe_dist_sum, moving and adding the partials */
    uint64_t sums, bytes;  /* moe_dist_sum calls, and the bytes of their buffers */
} moe_dist_times;
moe_dist_times moe_dist_timing(void); /* cumulative since the start */
const char *moe_dist_describe(void);  /* the MPI library, for --version */
/* The slice [begin, end) of an expert's intermediate (n_ff values) that rank `rank` of n_ranks
 * computes under MOE_SPLIT_ROWS. The down projection's quant blocks (`block` values, its type's
 * block_values) run along the intermediate, so the slice is whole blocks: the n_ff / block blocks
 * go out as evenly as they divide, rank r taking blocks [r nb / K, (r + 1) nb / K). When they do
 * not divide evenly the slices differ by a block; with fewer blocks than ranks some ranks get
 * none (they hold no routed expert of that layer and add zeros). */
typedef struct moe_split_range {
    int64_t begin, end;
} moe_split_range;
moe_split_range moe_split_rows_range(int64_t n_ff, int64_t block, int rank, int n_ranks);
/* Bytes of the trunk's routed-expert weights (NextN / MTP layers, split alike, left out as
 * `moe budget` counts them apart) rank `rank` of n_ranks holds under `split`: its share of the
 * stacked matrices (MOE_SPLIT_NONE: all of them), its slice of the gate / up biases by rows,
 * and the other biases and scales, which every rank holds whole; *all (when not NULL) gets the
 * model's. What `moe budget --split` predicts for a device. */
uint64_t moe_split_expert_bytes(const moe_model *m, moe_split split, int rank, int n_ranks,
                                uint64_t *all);

#endif
