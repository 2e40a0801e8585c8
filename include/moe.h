/* moe.h: the public face of libmoe.
 *
 * libmoe serves sparse mixture-of-experts language models from quantized GGUF weights. This
 * header holds what a program linking the library needs: version, status codes and the error
 * struct every fallible call fills. Each layer under src/ has its own internal header; nothing
 * here exposes their internals. */
#ifndef MOE_H
#define MOE_H

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_VERSION_STRING "0.1.0"

typedef enum moe_status {
    MOE_OK = 0,
    MOE_ERR_IO,          /* open/read/write/mmap failed */
    MOE_ERR_FORMAT,      /* the bytes are not what the format says they must be */
    MOE_ERR_RANGE,       /* a count, size or offset is out of the allowed range */
    MOE_ERR_NOMEM,       /* allocation refused */
    MOE_ERR_ARG,         /* a caller or user argument is wrong */
    MOE_ERR_UNSUPPORTED, /* valid, but not something moe can do (yet) */
    MOE_ERR_NOT_FOUND,   /* a named key, tensor or file does not exist */
    MOE_STATUS_COUNT
} moe_status;

#define MOE_ERROR_MSG_MAX 512

/* What went wrong and where; the first error set is kept. Zero-initialise before use. */
typedef struct moe_error {
    moe_status code;
    char msg[MOE_ERROR_MSG_MAX];
} moe_error;

const char *moe_version(void);

#ifdef __cplusplus
}
#endif
#endif
