/* C ABI of the losshead C++ client (liblosshead_capi.so): the data path for languages that load
 * a plain shared library (Python through ctypes), so that one implementation of the protocol,
 * the retries and the idempotency keys serves them all.
 *
 * Contract: handles are opaque and owned by the caller (free them with their *_free function).
 * Every call returns a gRPC status code (0: OK) and, when `status` is not null, fills it with
 * the code and message. Tensors are raw little-endian bytes in caller-owned buffers: inputs are
 * read during the call only, outputs are written during the call only. No call keeps a pointer
 * after it returns. Every function may be called from several threads at once, on the same
 * client too (a client is one gRPC channel; each call blocks only its own thread). Dtypes and
 * protobuf payloads are those of proto/losshead/v1/losshead.proto.
 *
 * Versions (LH_CAPI_VERSION): from version 3 on, a version only adds. A function or struct, once
 * in a released version, keeps its signature, layout and meaning; what a later version carries
 * comes in new functions taking new structs (version 4: lh_step_many_with_inputs beside
 * lh_step_many, lh_embedding_rows; version 5: the *_bias transfers beside lh_push_weights,
 * lh_pull_gradient and lh_download_weights; version 6: the same-node device path). So a caller
 * written for version N works with every
 * library whose lh_capi_version() is N or more, and checks that (not equality). Each function is
 * exported under the symbol version of the ABI version that added it (exports.map: LH_CAPI_3,
 * LH_CAPI_4, LH_CAPI_5, LH_CAPI_6).
 */
#ifndef LOSSHEAD_CAPI_H_
#define LOSSHEAD_CAPI_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LH_CAPI_VERSION 6

/* The ABI version this library implements (LH_CAPI_VERSION when it was built). */
int lh_capi_version(void);

typedef struct lh_status {
  int code;                /* grpc::StatusCode; 0: OK */
  uint32_t retry_after_ms; /* > 0: the server's hint on a transient refusal */
  int microbatch;          /* 1: one micro-batch's error (the stream went on), 0: the call's */
  char message[1024];      /* NUL-terminated, cut to fit */
} lh_status;

typedef struct lh_int_arg {
  const char* key;
  int value;
} lh_int_arg;

typedef struct lh_metadata {
  const char* key; /* lower case */
  const char* value;
} lh_metadata;

/* Connection options; zero / null fields take the C++ client's defaults (ClientOptions). */
typedef struct lh_client_options {
  uint64_t max_message_bytes;         /* largest message sent (pieces are cut below it) */
  uint64_t max_receive_message_bytes; /* largest accepted; 0: max_message_bytes */
  double deadline_s;                  /* each unary call, pull, push, download; <= 0: none */
  int dedicated_connection;           /* 1: a TCP connection of its own */
  /* TLS: on when `tls` is 1 or any PEM is given; PEM contents, not paths (NUL-terminated). */
  int tls;
  const char* tls_root_pem; /* null: the system's roots */
  const char* tls_cert_pem; /* client certificate and key, for mTLS: both or neither */
  const char* tls_key_pem;
  const char* tls_server_name; /* name to verify instead of the target's host */
  const char* bearer_token;    /* sent as `authorization: Bearer <token>` */
  /* Retry policy (losshead/client/retry.h); max_attempts 0: the defaults for all five. */
  int retry_max_attempts;
  double retry_initial_backoff_s;
  double retry_max_backoff_s;
  double retry_multiplier;
  double retry_jitter;
  const lh_int_arg* channel_args; /* integer gRPC channel arguments */
  size_t num_channel_args;
  const lh_metadata* metadata; /* sent on every call */
  size_t num_metadata;
} lh_client_options;

typedef struct lh_client lh_client;

/* Creates the channel (does not wait for the server). INVALID_ARGUMENT for bad options. */
int lh_client_connect(const char* target, const lh_client_options* options, lh_client** out,
                      lh_status* status);
void lh_client_free(lh_client* client);
/* Token for calls that start from now on; null or "": none. */
void lh_client_set_token(lh_client* client, const char* token);
/* Attempts that were retries (all calls) since connect. */
uint64_t lh_client_retries(const lh_client* client);

/* One micro-batch (losshead::client::Microbatch) and where its answer goes. */
typedef struct lh_microbatch {
  const char* head;
  const char* client_id;
  uint64_t sequence;
  int64_t num_tokens;
  int hidden_dtype;
  const void* hidden; /* num_tokens x D */
  size_t hidden_bytes;
  int target_dtype;
  const void* targets; /* num_tokens */
  size_t targets_bytes;
  const void* options; /* serialized losshead.v1.StepOptions; may be empty */
  size_t options_bytes;
  const void* loss_options; /* serialized losshead.v1.LossOptions; may be empty */
  size_t loss_options_bytes;
  void* grad_hidden_out; /* dH is written here; an answer with more bytes fails INTERNAL */
  size_t grad_hidden_capacity;
  float* per_token_loss_out;      /* per-token losses, when asked for; more fail INTERNAL */
  size_t per_token_loss_capacity; /* in floats */
  /* The token outputs asked in options.token_outputs, each where its pointer says (null: an
   * answer carrying it fails INTERNAL), `token_output_capacity` values each; more fail INTERNAL. */
  float* per_token_logprob_out;
  float* per_token_entropy_out;
  float* per_token_lse_out;
  int32_t* per_token_argmax_out;
  size_t token_output_capacity;
  /* The top-k (options.top_k = k): N x k ids and N x k log-probs, each where its pointer says
   * (null: an answer carrying it fails INTERNAL), `top_k_capacity` values each; more fail
   * INTERNAL. (Version 3.) */
  int32_t* top_k_ids_out;
  float* top_k_logprobs_out;
  size_t top_k_capacity;
} lh_microbatch;

typedef struct lh_step_result {
  lh_status status; /* this micro-batch's outcome; the fields below are set when it is OK */
  double loss;
  double loss_sum;
  int64_t token_count;
  uint64_t weights_version;
  int replayed;
  int forward_only;
  int grad_hidden_dtype;
  uint64_t grad_hidden_bytes;
  uint64_t per_token_loss_count;
  /* Values written to each token output's buffer (0: not in the answer). */
  uint64_t per_token_logprob_count;
  uint64_t per_token_entropy_count;
  uint64_t per_token_lse_count;
  uint64_t per_token_argmax_count;
  int has_correct_count; /* options.return_correct_count was answered: correct_count is set */
  int64_t correct_count;
  /* Values written to the top-k's buffers (0: not in the answer). (Version 3.) */
  uint64_t top_k_ids_count;
  uint64_t top_k_logprobs_count;
} lh_step_result;

/* Client::StepMany: the micro-batches over Step streams, up to `pipeline_depth` in flight,
 * retried under their idempotency keys; results[i] answers mbs[i]. Returns non-OK only when
 * the batch could not be started (unparsable options); per-micro-batch outcomes are in results.
 */
int lh_step_many(lh_client* client, const lh_microbatch* mbs, size_t count, size_t pipeline_depth,
                 lh_step_result* results, lh_status* status);

/* What version 4 adds to a micro-batch of lh_step_many_with_inputs: its kind and the per-token
 * fp32 inputs of the loss terms (losshead::client::Microbatch; which options take which: the
 * proto's StepRequest). Each input is given by a pointer and its count of values, which must be
 * the micro-batch's num_tokens; a null pointer with count 0 is an input not sent. */
typedef struct lh_microbatch_inputs {
  int kind; /* losshead.v1.StepKind: 0 STEP_KIND_LOSS, 1 STEP_KIND_EMBEDDING_GRAD (hidden carries
             * dE, targets the ids; see the proto) */
  const float* token_weights;
  size_t token_weights_count;
  const float* old_logprob;
  size_t old_logprob_count;
  const float* advantages;
  size_t advantages_count;
  const float* ref_logprob;
  size_t ref_logprob_count;
} lh_microbatch_inputs;

/* lh_step_many with `inputs[i]` for mbs[i] (null: none for any, which is lh_step_many). Returns
 * INVALID_ARGUMENT, sending nothing, for a null client, a null mbs or results with count > 0,
 * an input whose pointer is null with a count, or not null without one, or whose count is not
 * its micro-batch's num_tokens. (Version 4.) */
int lh_step_many_with_inputs(lh_client* client, const lh_microbatch* mbs,
                             const lh_microbatch_inputs* inputs, size_t count,
                             size_t pipeline_depth, lh_step_result* results, lh_status* status);

typedef struct lh_embedding_rows_info {
  int64_t num_rows;
  int64_t hidden_size;
  int dtype;
  uint64_t weights_version; /* every row was read at it */
} lh_embedding_rows_info;

/* Client::EmbeddingRows: the rows of W for `ids` (num_ids of them, each in [0, V); they must fit
 * one message: split them otherwise) in `dtype` (0: the head's) into `out`, num_ids x D of it;
 * has_expected_version: FAILED_PRECONDITION unless W is at `expected_version`. INVALID_ARGUMENT
 * for a null client, no ids or null ids; FAILED_PRECONDITION, `out` untouched, when the rows do
 * not fit `capacity` bytes (`info` is filled then too: the size they need). (Version 4.) */
int lh_embedding_rows(lh_client* client, const char* head, const int64_t* ids, size_t num_ids,
                      int dtype, int has_expected_version, uint64_t expected_version, void* out,
                      size_t capacity, lh_embedding_rows_info* info, lh_status* status);

/* Client::PushWeights from `data` (V x D of `dtype`); add: PUSH_MODE_ADD. A head with an output
 * bias takes W followed by b (V x D + V values) in one stream: from `data` alone (laid out so),
 * or from lh_push_weights_bias. */
int lh_push_weights(lh_client* client, const char* head, int dtype, const void* data, size_t bytes,
                    int add, int has_expected_version, uint64_t expected_version,
                    uint64_t* new_version, lh_status* status);

typedef struct lh_gradient_summary {
  int64_t vocab_size;
  int64_t hidden_size;
  int dtype;
  uint64_t token_count;
  uint64_t microbatch_count;
  uint64_t min_weights_version;
  uint64_t max_weights_version;
  uint64_t total_bytes;
  int was_reset;
} lh_gradient_summary;

/* Client::PullGradientInto: dW into `out` (at least V x D of `dtype`). A head with an output bias
 * (summary: see lh_pull_gradient_bias) sends db after dW, which lands after it in `out`: `out`
 * must then hold V x D + V values (FAILED_PRECONDITION otherwise, naming the bias; with `reset`
 * the window is then gone), or use lh_pull_gradient_bias. */
int lh_pull_gradient(lh_client* client, const char* head, int dtype, int reset, void* out,
                     size_t capacity, lh_gradient_summary* summary, lh_status* status);

typedef struct lh_weights_info {
  int64_t vocab_size;
  int64_t hidden_size;
  int dtype;
  uint64_t weights_version;
} lh_weights_info;

/* Client::DownloadWeightsInto: W into `out`; dtype 0: the head's. A head with an output bias:
 * b after W in `out` (V x D + V values; FAILED_PRECONDITION, naming the bias, when they do not
 * fit), or use lh_download_weights_bias. */
int lh_download_weights(lh_client* client, const char* head, int dtype, void* out, size_t capacity,
                        lh_weights_info* info, lh_status* status);

/* A head with an output bias b (HeadSpec.bias; V values, fp32 on the server, in the transfer's
 * dtype on the wire): W and b in buffers of their own. (Version 5.) */

/* lh_push_weights with b from `bias` (V values of `dtype`, `bias_bytes` bytes), sent after W's
 * `bytes` in the same stream: W and b change together, in one version. A head with a bias
 * answers INVALID_ARGUMENT, nothing changed, when the two lengths are not V x D and V values
 * (`bias` null with bias_bytes 0: none given); so does a head without a bias given one.
 * INVALID_ARGUMENT, sending nothing, for a null client or a null `bias` with bias_bytes > 0. */
int lh_push_weights_bias(lh_client* client, const char* head, int dtype, const void* data,
                         size_t bytes, const void* bias, size_t bias_bytes, int add,
                         int has_expected_version, uint64_t expected_version, uint64_t* new_version,
                         lh_status* status);

/* lh_pull_gradient with db in `bias_out` (at least V values of `dtype`; more left untouched):
 * `*bias_bytes` (when not null) is set to the bytes of db written, 0 for a head without a bias
 * (`bias_out` untouched). FAILED_PRECONDITION, nothing written, when dW does not fit `capacity`
 * or db `bias_capacity` (with `reset` the window is then gone, as after a lost answer: size the
 * buffers from the head). INVALID_ARGUMENT, sending nothing, for a null client or a null
 * `bias_out` with bias_capacity > 0. */
int lh_pull_gradient_bias(lh_client* client, const char* head, int dtype, int reset, void* out,
                          size_t capacity, void* bias_out, size_t bias_capacity,
                          lh_gradient_summary* summary, uint64_t* bias_bytes, lh_status* status);

/* lh_download_weights with b in `bias_out` (the same rules as lh_pull_gradient_bias). */
int lh_download_weights_bias(lh_client* client, const char* head, int dtype, void* out,
                             size_t capacity, void* bias_out, size_t bias_capacity,
                             lh_weights_info* info, uint64_t* bias_bytes, lh_status* status);

/* The same-node device path (docs/same-node.md, "The device path"): the caller's CUDA memory,
 * shared with a server on this host through its IPC handle; the server copies hidden states and
 * targets out of it and writes dH into it. The library has no CUDA: the caller makes the handle
 * (cudaIpcGetMemHandle; torch: storage._share_cuda_()) and owns the memory. (Version 6.) */

typedef struct lh_same_node_device {
  int index;           /* the server's device ordinal */
  char pci_bus_id[32]; /* "dddd:bb:dd.f", lower case, NUL-terminated */
} lh_same_node_device;

/* The server's devices where a device region opens (Stats.same_node.devices), asked once per
 * client: up to `capacity` into `out`, their number into `*count` (0: the server is not on this
 * host, offers no device path, or same-node is off). */
int lh_same_node_devices(lh_client* client, lh_same_node_device* out, size_t capacity,
                         size_t* count, lh_status* status);

typedef struct lh_device_region lh_device_region;

/* Registers [offset, offset + bytes) of the CUDA allocation of `ipc_handle` (handle_bytes bytes:
 * a cudaIpcMemHandle_t's 64), which lies on the device of `pci_bus_id`, with the client's server.
 * The server keeps it open until lh_device_region_free (or this process's death). The server's
 * refusal comes back with its code: FAILED_PRECONDITION when there is no same-node path, on a
 * server without CUDA devices or whose devices cannot reach that one; INVALID_ARGUMENT for a
 * handle that is not 64 bytes or does not open, bytes 0, or a range past the allocation's end. */
int lh_device_region_register(lh_client* client, const void* ipc_handle, size_t handle_bytes,
                              uint64_t offset, uint64_t bytes, const char* pci_bus_id,
                              lh_device_region** out, lh_status* status);
/* Unregisters it (the server closes its handle). Micro-batches naming it must be answered. */
void lh_device_region_free(lh_device_region* region);

/* Where a micro-batch's tensors lie in a device region (byte offsets from its start). With it
 * the micro-batch's hidden, targets and grad_hidden_out are not used (give null, 0). */
typedef struct lh_device_tensors {
  lh_device_region* region; /* null: the micro-batch goes as lh_step_many_with_inputs sends it */
  uint64_t hidden_offset;
  uint64_t hidden_bytes;
  uint64_t targets_offset;
  uint64_t targets_bytes;
  uint64_t grad_hidden_offset; /* where the server writes dH */
  uint64_t grad_hidden_bytes;  /* room there; 0 with skip_grad_hidden */
} lh_device_tensors;

/* The path a micro-batch's tensors took (lh_step_many_device's `paths`). */
#define LH_PATH_NETWORK 0
#define LH_PATH_SHARED_MEMORY 1
#define LH_PATH_DEVICE 2

/* lh_step_many_with_inputs with `devices[i]` for mbs[i] (null: none for any). Ordering: the
 * caller has finished writing every device region's hidden states and targets (synchronised the
 * stream that wrote them) before the call, and dH is in the region, written and synchronised by
 * the server, when the call returns. `paths` (null: not reported) gets each micro-batch's path
 * (LH_PATH_*; set for an answered one). A device micro-batch the server refuses is answered
 * with the refusal's code, as any other. (Version 6.) */
int lh_step_many_device(lh_client* client, const lh_microbatch* mbs,
                        const lh_microbatch_inputs* inputs, const lh_device_tensors* devices,
                        size_t count, size_t pipeline_depth, lh_step_result* results, int* paths,
                        lh_status* status);

#ifdef __cplusplus
}
#endif

#endif /* LOSSHEAD_CAPI_H_ */
