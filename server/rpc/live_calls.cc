#include "server/rpc/live_calls.h"

#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace losshead::server {
namespace {

constexpr absl::string_view kServicePrefix = "/losshead.v1.LossHead/";
constexpr absl::string_view kStepMethod = "/losshead.v1.LossHead/Step";

// gRPC creates one per call and destroys it when the call is over.
class CountingInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit CountingInterceptor(LiveCalls* calls) : calls_(calls) { calls_->Enter(); }
  ~CountingInterceptor() override { calls_->Leave(); }
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    methods->Proceed();
  }

 private:
  LiveCalls* const calls_;
};

class CountingFactory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit CountingFactory(LiveCalls* calls) : calls_(calls) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    const absl::string_view method = info->method();
    if (!absl::StartsWith(method, kServicePrefix) || method == kStepMethod) return nullptr;
    return new CountingInterceptor(calls_);
  }

 private:
  LiveCalls* const calls_;
};

}  // namespace

void LiveCalls::Enter() {
  absl::MutexLock lock(&mu_);
  ++count_;
}

void LiveCalls::Leave() {
  absl::MutexLock lock(&mu_);
  --count_;
}

bool LiveCalls::WaitUntilNone(absl::Time deadline) const {
  absl::MutexLock lock(&mu_);
  return mu_.AwaitWithDeadline(absl::Condition(
                                   +[](const int* count) { return *count == 0; }, &count_),
                               deadline);
}

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
LiveCalls::CountingFactory() {
  return std::make_unique<::losshead::server::CountingFactory>(this);
}

}  // namespace losshead::server
