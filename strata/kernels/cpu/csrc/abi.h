/* What a library shares with its Python bindings, as the compiler sees it: the size of each struct and the offset and
   size of each field the bindings mirror in ctypes, and the constants they mirror. Each library exports one
   `strata_abi_<library>` (STRATA_ABI_EXPORT at its end); strata/kernels/cpu/abi.py reads it at load and refuses a
   library whose layout or constants differ from its own. */
#ifndef STRATA_ABI_H
#define STRATA_ABI_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name; /* "type", "type.field" or "CONSTANT" */
    int64_t value;    /* sizeof, offsetof, or the constant's value */
    int64_t size;     /* alignment of a type, sizeof of a field, 0 for a constant */
} strata_abi_entry_t;

#define STRATA_ABI_TYPE(T) {#T, (int64_t)sizeof(T), (int64_t)_Alignof(T)},
#define STRATA_ABI_FIELD(T, F) {#T "." #F, (int64_t)offsetof(T, F), (int64_t)sizeof(((T *)0)->F)},
#define STRATA_ABI_CONST(C) {#C, (int64_t)(C), 0},

/* Entry i of the library's table (0 after filling the three outputs), or -1 past its end. */
#define STRATA_ABI_EXPORT(LIBRARY, ...)                                                                        \
    int strata_abi_##LIBRARY(int64_t i, const char **name, int64_t *value, int64_t *size) {                   \
        static const strata_abi_entry_t entries[] = {__VA_ARGS__{NULL, 0, 0}};                                \
        if (i < 0 || i >= (int64_t)(sizeof(entries) / sizeof(entries[0])) - 1) return -1;                     \
        *name = entries[i].name;                                                                               \
        *value = entries[i].value;                                                                             \
        *size = entries[i].size;                                                                               \
        return 0;                                                                                              \
    }

#endif
