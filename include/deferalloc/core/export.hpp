// Symbol visibility for deferalloc: everything is hidden (-fvisibility=hidden)
// except what a public header marks DFA_API.
#pragma once
#if defined(_WIN32)
#define DFA_API __declspec(dllexport)
#else
#define DFA_API __attribute__((visibility("default")))
#endif
