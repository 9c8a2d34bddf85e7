// Native frames of a crash, for the GPU check's test processes (native_trace.py builds this and
// preloads it). Python's faulthandler prints the Python frames of a fatal signal and then calls
// the handler it replaced, this one, which prints the native frames the fault went through:
// each as its library, its offset there, and the nearest exported symbol below it (a hint, not
// a name: a hidden function shows its exported neighbour's). Then the signal takes its default
// action, so the process still dies of it. It writes to the stderr the process started with,
// as faulthandler does: pytest points descriptor 2 at a capture file while a test runs.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static const int kSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT};
static int out = 2;  // a copy of the stderr at start, once install() has made it

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  void* frames[48];
  const int n = backtrace(frames, 48);
  // si_addr means the faulting address only where the kernel sent the signal (si_code > 0);
  // after faulthandler's raise() it is not one.
  if (info != NULL && info->si_code > 0) {
    dprintf(out, "fastddp-native-trace: signal %d at address %p, %d frames\n", sig,
            info->si_addr, n);
  } else {
    dprintf(out, "fastddp-native-trace: signal %d, %d frames\n", sig, n);
  }
  for (int i = 0; i < n; ++i) {
    Dl_info where;
    if (dladdr(frames[i], &where) != 0 && where.dli_fname != NULL) {
      dprintf(out, "fastddp-native-frame %d %s +0x%lx %s\n", i, where.dli_fname,
              (unsigned long)((uintptr_t)frames[i] - (uintptr_t)where.dli_fbase),
              where.dli_sname != NULL ? where.dli_sname : "?");
    } else {
      dprintf(out, "fastddp-native-frame %d ? %p ?\n", i, frames[i]);
    }
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  const int copy = fcntl(2, F_DUPFD_CLOEXEC, 3);
  out = copy >= 0 ? copy : 2;
  void* warm[1];
  backtrace(warm, 1);  // loads libgcc's unwinder now, not inside a signal handler
  struct sigaction action;
  memset(&action, 0, sizeof action);
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_NODEFER | SA_RESETHAND;
  for (size_t i = 0; i < sizeof kSignals / sizeof kSignals[0]; ++i) {
    sigaction(kSignals[i], &action, NULL);
  }
}
