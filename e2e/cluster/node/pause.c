/* The pod sandbox's process: it holds the pod's namespaces open and does nothing else.
 *
 * As PID 1 of a pod that shares its process namespace it must reap orphaned children, and it
 * exits at once on SIGINT/SIGTERM (the runtime's stop). Built static (gcc -static), so the image
 * is this one file. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static void stop(int signo) {
  (void)signo;
  _exit(0);
}

static void reap(int signo) {
  (void)signo;
  int saved = errno;
  while (waitpid(-1, NULL, WNOHANG) > 0) {
  }
  errno = saved;
}

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "-v") == 0) {
    printf("pause (sovereign)\n");
    return 0;
  }
  if (getpid() != 1) {
    /* Not fatal, as upstream's: useful when run by hand. */
    fprintf(stderr, "pause: warning: not PID 1\n");
  }
  struct sigaction on_stop = {.sa_handler = stop};
  struct sigaction on_child = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP | SA_RESTART};
  sigemptyset(&on_stop.sa_mask);
  sigemptyset(&on_child.sa_mask);
  if (sigaction(SIGINT, &on_stop, NULL) < 0 || sigaction(SIGTERM, &on_stop, NULL) < 0 ||
      sigaction(SIGCHLD, &on_child, NULL) < 0) {
    perror("pause: sigaction");
    return 1;
  }
  for (;;) {
    pause();
  }
}
