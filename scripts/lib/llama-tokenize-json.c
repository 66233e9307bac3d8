// Reference ids from llama.cpp: loads a GGUF file's vocabulary with libllama and prints, one JSON
// list per line, the ids of each NUL-terminated text on stdin (add_special and parse_special on,
// as a prompt is tokenized). Built by scripts/make-tokenizer-fixtures.py.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "llama.h"
int main(int argc, char **argv) {
    if (argc < 2) { fprintf(stderr, "usage: %s vocab.gguf < texts\n", argv[0]); return 2; }
    llama_backend_init();
    struct llama_model_params p = llama_model_default_params();
    p.vocab_only = true;
    struct llama_model *m = llama_model_load_from_file(argv[1], p);
    if (!m) { fprintf(stderr, "cannot load %s\n", argv[1]); return 1; }
    const struct llama_vocab *v = llama_model_get_vocab(m);
    static char buf[1 << 20];
    size_t n = fread(buf, 1, sizeof buf - 1, stdin);
    buf[n] = 0;
    static llama_token ids[1 << 18];
    for (size_t start = 0; start < n;) {
        size_t len = strlen(buf + start);
        int k = llama_tokenize(v, buf + start, (int)len, ids, 1 << 18, true, true);
        if (k < 0) { fprintf(stderr, "too many tokens\n"); return 1; }
        printf("[");
        for (int i = 0; i < k; i++) printf(i ? ",%d" : "%d", ids[i]);
        printf("]\n");
        start += len + 1;
    }
    llama_model_free(m);
    return 0;
}
