// The kernel registry shared by launcher.cpp and the per-file kernel units (scan.cpp, ...).
#pragma once

#include <stddef.h>

#include <type_traits>
#include <utility>

// Kinds of kernel arguments, as the Rust side passes them.
enum ArgKind { ARG_POINTER = 0, ARG_I32 = 1, ARG_U64 = 2, ARG_STRUCT = 3 };

struct KernelEntry {
    const char *name;
    size_t nargs;
    const int *kinds;    // ArgKind per argument
    const size_t *sizes; // bytes per argument
    void (*invoke)(void *const *args);
};

template <typename A> constexpr int arg_kind() {
    static_assert(std::is_pointer<A>::value || std::is_same<A, int>::value ||
                      std::is_same<A, unsigned long long>::value ||
                      (std::is_class<A>::value && std::is_trivially_copyable<A>::value),
                  "kernel arguments are pointers, int, unsigned long long or plain structs");
    return std::is_pointer<A>::value             ? ARG_POINTER
           : std::is_same<A, int>::value         ? ARG_I32
           : std::is_same<A, unsigned long long>::value ? ARG_U64
                                                 : ARG_STRUCT;
}

// Calls `f` with its arguments read from an array of pointers to them (as cuLaunchKernel).
template <typename... A> struct Invoker {
    template <void (*F)(A...)> static void invoke(void *const *args) {
        call<F>(args, std::index_sequence_for<A...>{});
    }
    template <void (*F)(A...), size_t... I>
    static void call(void *const *args, std::index_sequence<I...>) {
        F(*static_cast<typename std::remove_reference<A>::type *>(args[I])...);
    }
    static constexpr int kinds[sizeof...(A) + 1] = {arg_kind<A>()..., -1};
    static constexpr size_t sizes[sizeof...(A) + 1] = {sizeof(A)..., 0};
};

template <typename... A> constexpr size_t arity(void (*)(A...)) { return sizeof...(A); }
template <typename... A> constexpr const int *kinds_of(void (*)(A...)) {
    return Invoker<A...>::kinds;
}
template <typename... A> constexpr const size_t *sizes_of(void (*)(A...)) {
    return Invoker<A...>::sizes;
}
template <typename... A> constexpr Invoker<A...> invoker_of(void (*)(A...)) { return {}; }

// One registry entry for the kernel function `f` (an `extern "C"` function of a .cu file).
#define KERNEL_ENTRY(f) \
    KernelEntry {                                                                              \
        #f, arity(f), kinds_of(f), sizes_of(f), decltype(invoker_of(f))::template invoke<f>    \
    }
