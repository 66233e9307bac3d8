/* Generates text with the LeanStream C API, streaming it to stdout.
 *
 *   generate MODEL PROMPT [MAX_TOKENS [MEMORY_BYTES]]
 *   generate --chat MODEL FIRST_MESSAGE SECOND_MESSAGE [MAX_TOKENS]
 *
 * The first form writes two lines, the same greedy text (temperature 0) made twice: by
 * ls_generate, and by a token-level loop (ls_tokenize, ls_eval, ls_sample, ls_detokenize); both
 * equal `leanstream run --model MODEL -p PROMPT --temp 0 -n MAX_TOKENS`. The second form holds a
 * two-turn conversation through the model's chat template (ls_chat), one reply a line.
 * Exit status 2 and the library's message on stderr if the model cannot be opened.
 * Build: cc generate.c -I../include -L<target>/release -lleanstream_c -o generate */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "leanstream.h"

static bool print_piece(const char *piece, size_t len, void *user_data) {
    (void)user_data;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return true; /* false would stop the generation */
}

/* Appends each piece to a growing buffer (a reply kept for the next turn). */
typedef struct {
    char *text;
    size_t len;
} Reply;

static bool keep_piece(const char *piece, size_t len, void *user_data) {
    Reply *r = user_data;
    char *grown = realloc(r->text, r->len + len + 1);
    if (!grown) return false;
    r->text = grown;
    memcpy(r->text + r->len, piece, len);
    r->len += len;
    r->text[r->len] = '\0';
    return print_piece(piece, len, NULL);
}

static int fail(LsModel *model, int code) {
    fprintf(stderr, "error %d: %s\n", code, ls_last_error());
    if (model) ls_close(model);
    return 3;
}

static int chat(LsModel *model, const char *first, const char *second, uint32_t max_tokens) {
    LsGenerateOptions gen = ls_generate_options_default();
    gen.temperature = 0.0f;
    gen.max_tokens = max_tokens;
    Reply reply = {NULL, 0};
    LsMessage turns[3] = {{"user", first}, {"assistant", ""}, {"user", second}};
    LsStatus status = ls_chat(model, turns, 1, &gen, keep_piece, &reply);
    if (status != LS_STATUS_OK) return fail(model, status);
    printf("\n");
    turns[1].content = reply.text ? reply.text : "";
    status = ls_chat(model, turns, 3, &gen, print_piece, NULL);
    free(reply.text);
    if (status != LS_STATUS_OK) return fail(model, status);
    printf("\n");
    ls_close(model);
    return 0;
}

/* The greedy loop by hand: tokenize, evaluate, sample, until MAX_TOKENS or an end token. */
static int token_loop(LsModel *model, const char *prompt, uint32_t max_tokens) {
    size_t n = 0;
    ls_tokenize(model, prompt, true, NULL, 0, &n); /* asks for the count */
    size_t room = n + max_tokens;
    uint32_t *tokens = malloc(room * sizeof *tokens);
    LsStatus status = ls_tokenize(model, prompt, true, tokens, room, &n);
    if (status != LS_STATUS_OK) return fail(model, status);
    LsGenerateOptions gen = ls_generate_options_default();
    gen.temperature = 0.0f;
    size_t prompt_len = n;
    status = ls_eval(model, tokens, n);
    for (uint32_t i = 0; status == LS_STATUS_OK && i < max_tokens; i++) {
        uint32_t next;
        status = ls_sample(model, &gen, &next);
        if (status != LS_STATUS_OK || ls_is_end_token(model, next)) break;
        tokens[n++] = next;
        if (i + 1 < max_tokens) status = ls_eval(model, &next, 1);
    }
    if (status != LS_STATUS_OK) return fail(model, status);
    size_t len = 0;
    ls_detokenize(model, tokens + prompt_len, n - prompt_len, NULL, 0, &len);
    char *text = malloc(len + 1);
    status = ls_detokenize(model, tokens + prompt_len, n - prompt_len, text, len + 1, &len);
    if (status != LS_STATUS_OK) return fail(model, status);
    printf("%s\n", text);
    free(text);
    free(tokens);
    ls_reset(model);
    return 0;
}

int main(int argc, char **argv) {
    bool chat_mode = argc > 1 && strcmp(argv[1], "--chat") == 0;
    if (argc < 3 || (chat_mode && argc < 5)) {
        fprintf(stderr,
                "usage: %s MODEL PROMPT [MAX_TOKENS [MEMORY_BYTES]]\n"
                "       %s --chat MODEL FIRST SECOND [MAX_TOKENS]\n",
                argv[0], argv[0]);
        return 1;
    }
    if (ls_abi_version() != LEANSTREAM_ABI_VERSION) {
        fprintf(stderr, "the library (%s) is not the one this program was built for\n",
                ls_version());
        return 1;
    }
    LsOpenOptions open = ls_open_options_default();
    if (!chat_mode && argc > 4) open.memory_bytes = strtoull(argv[4], NULL, 10);
    LsModel *model = NULL;
    LsStatus status = ls_open(argv[chat_mode ? 2 : 1], &open, &model);
    if (status != LS_STATUS_OK) {
        fprintf(stderr, "error %d: %s\n", (int)status, ls_last_error());
        return 2;
    }
    if (chat_mode) {
        uint32_t max_tokens = argc > 5 ? (uint32_t)strtoul(argv[5], NULL, 10) : 32;
        return chat(model, argv[3], argv[4], max_tokens);
    }
    LsGenerateOptions gen = ls_generate_options_default();
    gen.temperature = 0.0f;
    if (argc > 3) gen.max_tokens = (uint32_t)strtoul(argv[3], NULL, 10);
    status = ls_generate(model, argv[2], &gen, print_piece, NULL);
    if (status != LS_STATUS_OK) return fail(model, status);
    printf("\n");
    LsMetrics m;
    ls_metrics(model, &m);
    fprintf(stderr, "%llu prompt tokens, %llu generated at %.1f tok/s, peak RSS %.1f MiB\n",
            (unsigned long long)m.prompt_tokens, (unsigned long long)m.generated_tokens,
            m.tokens_per_s, m.peak_rss_bytes / 1048576.0);
    int code = token_loop(model, argv[2], gen.max_tokens);
    if (code == 0) ls_close(model);
    return code;
}
