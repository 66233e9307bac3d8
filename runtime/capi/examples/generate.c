/* Generates text with the LeanStream C API, streaming it to stdout.
 *
 *   generate MODEL PROMPT [MAX_TOKENS [MEMORY_BYTES]]
 *
 * Greedy (temperature 0), so the text equals `leanstream run --model MODEL -p PROMPT --temp 0
 * -n MAX_TOKENS`. Exit status 2 and the library's message on stderr if the model cannot be opened.
 * Build: cc generate.c -I../include -L<target>/release -lleanstream_c -o generate */
#include <stdio.h>
#include <stdlib.h>

#include "leanstream.h"

static bool print_piece(const char *piece, size_t len, void *user_data) {
    (void)user_data;
    fwrite(piece, 1, len, stdout);
    fflush(stdout);
    return true; /* false would stop the generation */
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s MODEL PROMPT [MAX_TOKENS [MEMORY_BYTES]]\n", argv[0]);
        return 1;
    }
    LsOpenOptions open = ls_open_options_default();
    if (argc > 4) open.memory_bytes = strtoull(argv[4], NULL, 10);
    LsModel *model = NULL;
    LsStatus status = ls_open(argv[1], &open, &model);
    if (status != LS_STATUS_OK) {
        fprintf(stderr, "error %d: %s\n", (int)status, ls_last_error());
        return 2;
    }
    LsGenerateOptions gen = ls_generate_options_default();
    gen.temperature = 0.0f;
    if (argc > 3) gen.max_tokens = (uint32_t)strtoul(argv[3], NULL, 10);
    status = ls_generate(model, argv[2], &gen, print_piece, NULL);
    if (status != LS_STATUS_OK) {
        fprintf(stderr, "error %d: %s\n", (int)status, ls_last_error());
        ls_close(model);
        return 3;
    }
    printf("\n");
    LsMetrics m;
    ls_metrics(model, &m);
    fprintf(stderr, "%llu prompt tokens, %llu generated at %.1f tok/s, peak RSS %.1f MiB\n",
            (unsigned long long)m.prompt_tokens, (unsigned long long)m.generated_tokens,
            m.tokens_per_s, m.peak_rss_bytes / 1048576.0);
    ls_close(model);
    return 0;
}
